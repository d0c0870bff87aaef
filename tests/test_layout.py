"""The shape the project holds itself to (issue 56): a small core in common/ that imports no feature, each feature
a module of its own, and scripts a reader can hold: at most 600 lines and 32 KB, Args at most a quarter of the file,
no nested function in main() that rebinds the loop's state."""

import ast
import io
import os
import tokenize

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = ["runtime", "data", "models", "generation", "rewards", "tracking", "checkpoint"]
# each entered only on its flags (README)
FEATURES = ["vllm", "sampler_correction", "episodes", "rollouts", "resume", "packing", "reward_extras", "event_loop"]
SCRIPTS = ["sft", "reward", "dpo", "kto", "online_dpo", "rloo", "grpo", "ppo", "gkd"]


def code_lines(source: str) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring (a module's, class's or
    function's first string, or a string standing alone as a statement: the fields' docstrings)."""
    docs = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            docs.update(range(node.lineno, node.end_lineno + 1))
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                            tokenize.ENDMARKER):
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines - docs)


def read(path: str) -> str:
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def test_code_lines_are_counted_without_docstrings_comments_and_blanks():
    source = '"""module\ndoc"""\n\nimport os  # why\n\n\ndef f(x):\n    """doc"""\n    # note\n    return (x +\n' \
             '            1)\n\n\nclass A:\n    a: int = 1\n    """field doc"""\n'
    assert code_lines(source) == 6  # import, def, return (2 lines), class, a


def test_the_core_is_at_most_900_code_lines_and_each_feature_about_250():
    core = {m: code_lines(read(f"common/{m}.py")) for m in CORE}
    features = {m: code_lines(read(f"common/{m}.py")) for m in FEATURES}
    assert sum(core.values()) <= 900, core
    assert all(n <= 260 for n in features.values()), features
    listed = {f[:-3] for f in os.listdir(os.path.join(ROOT, "common")) if f.endswith(".py") and f != "__init__.py"}
    assert listed == set(CORE) | set(FEATURES), "a new module of common/ belongs to the core or is a feature"


@pytest.mark.parametrize("module", CORE)
def test_the_core_imports_no_feature(module):
    tree = ast.parse(read(f"common/{module}.py"))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {f"common.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "common"
                 for a in n.names}
    assert not imported & {f"common.{f}" for f in FEATURES}


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_script_is_at_most_600_lines_and_32_kb_its_args_a_quarter(script):
    source = read(f"algos/{script}.py")
    lines = source.splitlines()
    assert len(lines) <= 600 and len(source.encode()) <= 32 * 1024, (len(lines), len(source.encode()))
    assert max(map(len, lines)) <= 120
    args = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "Args")
    start = args.lineno - len(args.decorator_list)
    assert args.end_lineno - start + 1 <= len(lines) / 4, (start, args.end_lineno, len(lines))


@pytest.mark.parametrize("script", SCRIPTS)
def test_main_has_no_nested_function_that_rebinds_its_state(script):
    main = next(n for n in ast.parse(read(f"algos/{script}.py")).body
                if isinstance(n, ast.FunctionDef) and n.name == "main")
    assert not [n for n in ast.walk(main) if isinstance(n, (ast.Nonlocal, ast.Global))]


def test_grpo_reaches_its_math_before_line_200():
    first = min(n.lineno for n in ast.parse(read("algos/grpo.py")).body if isinstance(n, ast.FunctionDef))
    assert first < 200

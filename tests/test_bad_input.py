"""Bad input to the scripts: one line on stderr naming the problem, exit status 2, no traceback,
and nothing already saved in the output directory is touched."""

import fcntl
import importlib
import json
import os
import pty
import struct
import subprocess
import sys
import termios
import time

import pytest
from transformers import AutoTokenizer

from algos import dpo, kto, reward, sft
from common.runtime import UserError
from tests.conftest import ROOT, run_script, script_args


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_cli_error_is_one_line_exit_2_and_leaves_saved_model_untouched(tmp_path, sft_model):
    before = {f: os.path.getmtime(os.path.join(sft_model, f)) for f in os.listdir(sft_model)}
    bad = write_jsonl(tmp_path / "cols.jsonl", [{"prompt": "a", "answer": "b"}])
    proc = run_script("algos/sft.py", "--dataset_name", bad, "--output_dir", sft_model, "--overwrite_output_dir",
                      check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: dataset '{bad}' (split train), given to sft.py, has columns [prompt, answer], which "
                      "fit no accepted format: prompt-completion (prompt, completion: missing completion); "
                      "messages (messages: missing messages); language modelling (text: missing text)"]
    assert {f: os.path.getmtime(os.path.join(sft_model, f)) for f in os.listdir(sft_model)} == before


def sft_args(tmp_path, **kw):
    defaults = dict(max_steps=1, per_device_train_batch_size=2, dataset_test_split="", output_dir=str(tmp_path / "out"))
    return script_args(sft.Args, **{**defaults, **kw})


def test_bad_inputs_to_sft(tmp_path, tiny_model):
    rows = [{"prompt": "TITLE: a\n\nTL;DR:", "completion": " b"}] * 4
    ok = write_jsonl(tmp_path / "ok.jsonl", rows)
    cases = [
        (dict(dataset_name=str(tmp_path / "missing")), "could not load dataset"),
        (dict(model_name_or_path=str(tmp_path / "nope")), "could not load"),
        (dict(dataset_name=ok, dataset_test_split="validation"), "no split 'validation'"),
        (dict(dataset_name=ok, max_length=3), "no training row has a token to learn within max_length=3"),
        (dict(dataset_name=ok, per_device_train_batch_size=8, max_steps=-1),
         "4 training examples make no full batch of 8 (per_device_train_batch_size 8"),
    ]
    for kw, message in cases:
        with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
            sft.main(sft_args(tmp_path, **kw))
    assert not os.path.exists(tmp_path / "out" / "config.json")


@pytest.mark.parametrize("rows,message", [
    ([{"prompt": "a", "chosen": "b"}],
     r"columns \[prompt, chosen\].*preference \(prompt, chosen, rejected: missing rejected\)"),
    ([{"prompt": "a", "chosen": " b", "rejected": " b"}] * 3, "no training pair left"),
])
def test_bad_inputs_to_reward(tmp_path, sft_model, rows, message):
    args = script_args(reward.Args, model_name_or_path=sft_model, dataset_name=write_jsonl(tmp_path / "d.jsonl", rows),
                       dataset_test_split="", max_steps=1, output_dir=str(tmp_path / "rm"))
    with pytest.raises(UserError, match=message):
        reward.main(args)


def test_reward_without_an_sft_model_says_so(tmp_path):
    with pytest.raises(UserError, match="could not load the reward model's tokenizer 'nowhere/sft'"):
        reward.main(script_args(reward.Args, model_name_or_path="nowhere/sft", output_dir=str(tmp_path / "rm")))


@pytest.mark.parametrize("rows,extra,message", [
    ([{"prompt": "a", "chosen": " b", "rejected": " b"}, {"prompt": "a", "chosen": "", "rejected": " c"},
      {"prompt": "a " * 40, "chosen": " b", "rejected": " c"}], {},
     "no pair of split 'train' is left to train on: 1 chosen == rejected, 1 empty completion, "
     "1 prompt leaves no room under max_length=32"),
    ([{"chosen": "red", "rejected": "blue"}], {},
     "left to train on: 1 without a prompt column, chosen and rejected share"),
    ([{"prompt": "a", "chosen": " b", "rejected": " c"}], {"precompute_ref_logps": True, "sync_ref_model": True},
     "exclude each other"),
    ([{"prompt": "a", "chosen": " b", "rejected": " c"}], {"loss_type": "robust", "label_smoothing": 0.5},
     "robust needs 0 <= label_smoothing < 0.5"),
])
def test_bad_inputs_to_dpo(tmp_path, sft_model, rows, extra, message):
    args = script_args(dpo.Args, model_name_or_path=sft_model, dataset_name=write_jsonl(tmp_path / "d.jsonl", rows),
                    dataset_test_split="", max_steps=1, max_length=32, output_dir=str(tmp_path / "dpo"), **extra)
    with pytest.raises(UserError, match=message):
        dpo.main(args)


@pytest.mark.parametrize("rows,extra,message", [
    ([{"prompt": "a", "completion": " ", "label": True}, {"prompt": "a", "completion": " b", "label": "yes"}], {},
     "no row of split 'train' is left to train on: 1 empty completion, 1 label not true/false"),
    ([{"prompt": "a", "completion": " b"}], {}, r"unpaired \(prompt, completion, label: missing label\)"),
    ([{"prompt": "a", "completion": " b", "label": True}], {"per_device_train_batch_size": 1}, "must be >= 2"),
])
def test_bad_inputs_to_kto(tmp_path, sft_model, rows, extra, message):
    args = script_args(kto.Args, model_name_or_path=sft_model, dataset_name=write_jsonl(tmp_path / "d.jsonl", rows),
                    dataset_test_split="", max_steps=1, output_dir=str(tmp_path / "kto"), **extra)
    with pytest.raises(UserError, match=message):
        kto.main(args)


def test_scale_out_options_fail_early_with_one_line(tmp_path, sft_model, monkeypatch):
    from algos import grpo

    common = dict(model_name_or_path=sft_model, reward_model_paths=[], reward_funcs=["tests.toy_rewards:short"],
                  max_steps=1, per_device_train_batch_size=4, num_generations=2, output_dir=str(tmp_path / "out"))
    monkeypatch.setitem(__import__("sys").modules, "vllm", None)  # as if vLLM were not installed
    with pytest.raises(UserError, match=r"--use_vllm needs vLLM: pip install 'minimal-post-training\[vllm\]'"):
        grpo.main(script_args(grpo.Args, use_vllm=True, **common))
    monkeypatch.setitem(__import__("sys").modules, "peft", None)
    with pytest.raises(UserError, match=r"--use_peft needs peft: pip install 'minimal-post-training\[peft\]'"):
        grpo.main(script_args(grpo.Args, use_peft=True, **common))
    with pytest.raises(UserError, match="--sync_ref_model mixes the policy into a separate reference"):
        dpo.main(script_args(dpo.Args, model_name_or_path=sft_model, use_peft=True, sync_ref_model=True))


def test_a_server_that_never_comes_up_is_one_clear_error():
    from common.vllm import wait_for_server

    start = time.time()
    with pytest.raises(UserError, match=r"no vLLM server answered at http://127.0.0.1:9 within 2 s; start one with "):
        wait_for_server("127.0.0.1", 9, 2)  # nothing listens on port 9
    assert time.time() - start < 10


# ---------------------------------------------------------------------------------------------
# The bad-input sweep: every script, every kind of bad input, one UserError (no model trains)
# ---------------------------------------------------------------------------------------------
SCRIPTS = ["sft", "reward", "dpo", "kto", "grpo", "rloo", "online_dpo", "ppo", "gkd"]
OFFLINE, ONLINE = SCRIPTS[:4], SCRIPTS[4:8]  # gkd: prompt-completion rows, half of them sampled
PROMPT = "TITLE: a\n\nTL;DR:"
GOOD_ROWS = {"sft": [{"prompt": PROMPT, "completion": " b"}] * 4,
             **{s: [{"prompt": PROMPT, "chosen": " b", "rejected": " c"}] * 4 for s in ("reward", "dpo", "kto")},
             **{s: [{"prompt": PROMPT}] * 4 for s in ONLINE}, "gkd": [{"prompt": PROMPT, "completion": " b"}] * 4}
REWARD = ["tests.toy_rewards:short"]
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
SCRIPT_ARGS = {**{s: dict(dataset_test_split="") for s in OFFLINE},
               "grpo": dict(reward_model_paths=[], reward_funcs=REWARD, num_generations=2, max_completion_length=4),
               "rloo": dict(reward_model_paths=[], reward_funcs=REWARD, rloo_k=2, max_completion_length=4),
               "online_dpo": dict(reward_model_paths=[], reward_funcs=REWARD, max_new_tokens=4),
               "ppo": dict(reward_model_path="<one_label>", response_length=4),
               "gkd": dict(teacher_model_name_or_path="<causal_lm>", max_new_tokens=4, lmbda=0.5)}


def renamed(old, new):
    return lambda rows: [{new if k == old else k: v for k, v in r.items()} for r in rows]


def setting(column, value, row=None):
    return lambda rows: [{**r, column: value} if row in (None, i) else r for i, r in enumerate(rows)]


def conversational(rows):
    return [{k: [{"role": "user" if k == "prompt" else "assistant", "content": v}] for k, v in r.items()} for r in rows]


CASES = [  # (script, case, rows from the script's good rows, Args fields, the error's pattern)
    # 1. missing or renamed columns
    ("sft", "columns", renamed("completion", "response"), {}, r"columns \[prompt, response\].*missing completion"),
    ("reward", "columns", renamed("prompt", "question"), {}, "no training pair left: 4 without a prompt column, chosen "
     "and rejected share no start"),
    ("dpo", "columns", renamed("rejected", "response"), {}, r"implicit prompt \(chosen, rejected: missing rejected\)"),
    ("kto", "columns", renamed("chosen", "response"), {}, r"missing completion, label\); preference .*missing chosen"),
    *[(s, "columns", renamed("prompt", "question"), {}, r"columns \[question\].*prompt-only \(prompt: missing prompt\)")
      for s in ONLINE],
    ("gkd", "columns", renamed("completion", "response"), {}, r"--lmbda 0.5 trains 50% of prompts on the dataset's "
     "completions, but '.*' has no completion column"),
    # 2. an empty split
    *[(s, "empty", lambda rows: [], {}, "has an empty split") for s in SCRIPTS],
    # 3. text fields that are neither strings nor lists of messages
    ("sft", "types", setting("prompt", 3), {}, "has int '3' in column 'prompt' at row 0; each prompt must be a string"),
    ("sft", "types", lambda rows: [{"messages": "hi"}] * 2, {}, "has str 'hi' in column 'messages' at row 0; each "
     "messages must be a non-empty list"),
    ("sft", "types", setting("completion", [{"role": "assistant", "content": "b"}]), {},
     r"mixes strings \(column 'prompt'\) with lists of messages \(column 'completion'\)"),
    ("reward", "types", setting("chosen", None, row=1), {}, "has null in column 'chosen' at row 1"),
    ("dpo", "types", setting("rejected", ["b", "c"]), {}, "has list .* in column 'rejected' at row 0"),
    ("kto", "types", setting("prompt", [{"role": "user"}]), {}, "has list .* in column 'prompt' at row 0"),
    ("grpo", "types", setting("prompt", 3), {}, "has int '3' in column 'prompt' at row 0"),
    ("rloo", "types", setting("prompt", None, row=2), {}, "has null in column 'prompt' at row 2"),
    ("online_dpo", "types", setting("prompt", ["a"]), {}, "has list .* in column 'prompt' at row 0"),
    ("ppo", "types", setting("prompt", {"text": "a"}), {}, "has dict .* in column 'prompt' at row 0"),
    ("gkd", "types", setting("completion", 5, row=3), {}, "has int '5' in column 'completion' at row 3"),
    # 4. every prompt longer than the length limit (sft, dpo: above; the online scripts keep a prompt's end)
    ("reward", "too_long", None, dict(max_length=3), "no training pair left: 4 longer than max_length=3"),
    ("kto", "too_long", None, dict(max_length=3), "8 prompt leaves no room under max_length=3"),
    # 5. conversations, but a tokenizer has no chat template: the error names its role and path
    *[(s, "chat", conversational, {}, "conversational .* but the " + {"reward": "reward model", "gkd": "student"}.get(
        s, "policy") + "'s tokenizer '.*tiny-pythia' has no chat template") for s in SCRIPTS],
    *[(s, "rm_chat", conversational, dict(model_name_or_path="<chat_lm>", reward_model_paths=["<one_label>"]),
       "conversational .* but the reward model 1's tokenizer '.*one_label' has no chat template")
      for s in ("grpo", "rloo", "online_dpo")],
    # 6. a reward model with two labels (or reward training started from one)
    ("reward", "labels", None, dict(model_name_or_path="<two_labels>"), "is a sequence classifier with 2 labels"),
    *[(s, "labels", None, dict(reward_model_paths=["<two_labels>"]), "is a sequence classifier with 2 labels")
      for s in ("grpo", "rloo", "online_dpo")],
    ("ppo", "labels", None, dict(reward_model_path="<two_labels>"), "is a sequence classifier with 2 labels"),
    # 7. a reward function (or judge) that raises or returns the wrong thing (these sample one batch)
    ("grpo", "reward_fn", None, dict(reward_funcs=["tests.toy_rewards:broken"]),
     "reward function 'broken' raised ZeroDivisionError"),
    ("rloo", "reward_fn", None, dict(reward_funcs=["tests.toy_rewards:one_value"]),
     "'one_value' returned 1 values for 2 completions"),
    ("online_dpo", "reward_fn", None, dict(judge="tests.toy_rewards:one_value"),
     r"returned '\[0.0\]'; it must return 0 or 1 .* 2 pairs"),
    ("online_dpo", "reward_fn", None, dict(judge="tests.toy_rewards:broken"),
     "judge 'tests.toy_rewards:broken' raised ZeroDivisionError"),
    ("ppo", "reward_fn", None, dict(reward_funcs=["tests.toy_rewards:not_numbers"]),
     "'not_numbers' returned str 'good'"),
    ("ppo", "unscored", None, dict(reward_funcs=["tests.toy_rewards:none"], reward_weights=[0.0, 1.0]),
     "a response has no reward: the reward model has weight 0"),
    ("grpo", "all_weight_0", None, dict(reward_funcs=REWARD, reward_weights=[0.0]), "every reward has weight 0"),
    # 8. fewer examples than one batch, even with --max_steps (num_generations / rloo_k that do not
    # divide the batch: tests/test_grpo.py, tests/test_rloo.py)
    *[(s, "batch", lambda rows: rows[:1], dict(per_device_train_batch_size=4), "make no full batch of 4")
      for s in OFFLINE],
    *[(s, "batch", lambda rows: rows[:1], dict(per_device_train_batch_size=4), "1 prompts make no full batch of")
      for s in [*ONLINE, "gkd"]],
    # 9. sizes, counts and rates that must be positive, and online sampling at temperature 0
    *[(s, "batch0", None, dict(per_device_train_batch_size=0), "--per_device_train_batch_size must be "
       + (">= 2" if s == "kto" else r"> 0 \(got 0\)")) for s in SCRIPTS],
    *[(s, "lr", None, dict(learning_rate=-1.0), r"--learning_rate must be > 0 \(got -1.0\)") for s in SCRIPTS],
    *[(s, "temperature", None, dict(temperature=0.0), r"--temperature must be > 0 \(got 0.0\); online RL samples")
      for s in [*ONLINE, "gkd"]],
    *[(s, "sapo_tau", None, dict(sapo_temperature_neg=0.0), r"--sapo_temperature_neg must be > 0 \(got 0.0\)")
      for s in ("grpo", "rloo")],
    ("grpo", "entropy_quantile", None, dict(top_entropy_quantile=0.0), r"--top_entropy_quantile must be > 0"),
    # 10. SFT conversations with no assistant turn to learn
    ("sft", "no_assistant", lambda rows: [{"messages": [{"role": "user", "content": "a"}]}] * 4, {},
     "row 0: its messages hold no assistant turn"),
    # 11. a causal LM where a reward model belongs (its score head would be random), and an inf reward
    *[(s, "causal_rm", None, dict(reward_model_paths=["<causal_lm>"]), "is not a reward model .GPTNeoXForCausalLM")
      for s in ("grpo", "rloo", "online_dpo")],
    ("ppo", "causal_rm", None, dict(reward_model_path="<causal_lm>"), "is not a reward model .GPTNeoXForCausalLM"),
    ("grpo", "reward_inf", None, dict(reward_funcs=["tests.toy_rewards:infinite"]),
     "reward function 'infinite' returned inf for completion 0"),
    # 12. a model or tokenizer that does not load: the error names its role and path
    ("sft", "path", None, dict(model_name_or_path="nowhere/sft"),
     "could not load the policy's tokenizer 'nowhere/sft'"),
    ("reward", "path", None, dict(model_name_or_path="nowhere/sft"),
     "could not load the reward model's tokenizer 'nowhere/sft'"),
    *[(s, "ref_path", None, dict(ref_model_name_or_path="nowhere/ref"), "could not load the reference 'nowhere/ref'")
      for s in ("dpo", "kto")],
    ("grpo", "path", None, dict(reward_model_paths=["<one_label>", "nowhere/rm"]),
     "could not load the reward model 2's tokenizer 'nowhere/rm'"),
    ("ppo", "path", None, dict(reward_model_path="nowhere/rm"),
     "could not load the reward model's tokenizer 'nowhere/rm'"),
    ("gkd", "path", None, dict(teacher_model_name_or_path="nowhere/teacher"),
     "could not load the teacher's tokenizer 'nowhere/teacher'"),
    # 13. a repetition penalty with the sampler correction: vLLM's logprobs include it, the trainer's do not
    *[(s, "penalty_and_correction", None, dict(use_vllm=True, vllm_importance_sampling_cap=2.0, repetition_penalty=1.1),
       "--repetition_penalty with --vllm_importance_sampling_cap: vLLM's logprobs include the penalty")
      for s in ("grpo", "rloo")],
    # 14. distillation: a teacher with another vocabulary, divergence settings out of range, the token-reward
    # variant off the student's own samples
    ("gkd", "vocabulary", None, dict(teacher_model_name_or_path="<other_vocabulary>"),
     r"the teacher '.*other_vocabulary' \(\d+ tokens\) and the student '.*tiny-pythia' \(\d+ tokens\) have "
     "different vocabularies"),
    ("gkd", "lmbda", None, dict(lmbda=1.5), r"--lmbda 1.5 and --beta 1.0 must lie in \[0, 1\]"),
    ("gkd", "beta", None, dict(beta=-0.1), r"--lmbda 0.5 and --beta -0.1 must lie in \[0, 1\]"),
    ("gkd", "token_reward", None, dict(loss_type="token_reward"), "needs --lmbda 1 and --temperature 1"),
    ("gkd", "episodes_off_policy", conversational, dict(environment_factory="tests.toy_tools:Calculator"),
     r"--tools and --environment_factory distil the student's own episodes: use --lmbda 1 \(got 0.5"),
]


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory, tiny_model):
    """<two_labels> / <one_label>: classifiers from the tiny model; <causal_lm>: the tiny model itself;
    <chat_lm>: the tiny model with a chat template; <other_vocabulary>: the tiny model, a token added to its
    tokenizer."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    root = tmp_path_factory.mktemp("bad_models")
    paths = {name: str(root / name) for name in ("two_labels", "one_label", "chat_lm", "other_vocabulary")}
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    for name, num_labels in (("two_labels", 2), ("one_label", 1)):
        model = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=num_labels)
        model.save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
    AutoModelForCausalLM.from_pretrained(tiny_model).save_pretrained(paths["chat_lm"])
    AutoModelForCausalLM.from_pretrained(tiny_model).save_pretrained(paths["other_vocabulary"])
    other = AutoTokenizer.from_pretrained(tiny_model)
    other.add_tokens(["<extra>"])
    other.save_pretrained(paths["other_vocabulary"])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(paths["chat_lm"])
    return {**{f"<{name}>": path for name, path in paths.items()}, "<causal_lm>": tiny_model}


@pytest.mark.parametrize("script,case,rows,kw,message", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_bad_input_is_one_user_error(tmp_path, tiny_model, bad_models, script, case, rows, kw, message):
    module = importlib.import_module(f"algos.{script}")
    data = write_jsonl(tmp_path / "d.jsonl", (rows or (lambda r: r))(GOOD_ROWS[script]))
    kw = {**dict(model_name_or_path=tiny_model, dataset_name=data, max_steps=1, per_device_train_batch_size=2,
                 output_dir=str(tmp_path / "out")), **SCRIPT_ARGS[script], **kw}
    fill = lambda v: bad_models.get(v, v) if isinstance(v, str) else v  # noqa: E731 "<two_labels>" -> its path
    kw = {k: [fill(x) for x in v] if isinstance(v, list) else fill(v) for k, v in kw.items()}
    with pytest.raises(UserError, match=message):
        module.main(script_args(module.Args, **kw))


def test_progress_bars_on_a_terminal_only_and_an_error_after_one_starts_on_its_own_line(tmp_path, tiny_model):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": PROMPT}] * 4)
    argv = ["algos/grpo.py", "--model_name_or_path", tiny_model, "--dataset_name", data, "--reward_model_paths",
            "--reward_funcs", "tests.toy_rewards:infinite", "--num_generations", "2", "--per_device_train_batch_size",
            "2", "--max_completion_length", "4", "--max_steps", "1", "--output_dir", str(tmp_path / "out")]
    proc = run_script(*argv, check=False)  # stderr a pipe, as a log file: no progress bar in it
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "it/s" not in proc.stderr and "|" not in proc.stderr.split("error: ")[0], proc.stderr[-2000:]
    master, terminal = pty.openpty()  # stderr a terminal: the bars draw, and the error starts on a line of its own
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 100 columns (a new one has 0)
    run = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=terminal)
    os.close(terminal)
    shown = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the script ended
            break
        if not chunk:
            break
        shown += chunk
    os.close(master)
    shown = shown.decode(errors="replace")
    assert run.wait() == 2 and "|" in shown.split("error: ")[0], shown[-2000:]  # a bar drawn before the error ...
    assert shown.count("error: ") == 1 and "\nerror: reward function 'infinite' returned inf" in shown


def test_cli_error_of_an_online_script_is_one_line_exit_2(tmp_path, tiny_model):
    bad = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}, {"prompt": None}])
    proc = run_script("algos/grpo.py", "--model_name_or_path", tiny_model, "--dataset_name", bad,
                      "--reward_model_paths", "--reward_funcs",
                      "tests.toy_rewards:short", "--output_dir", str(tmp_path / "out"), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert [line for line in proc.stderr.splitlines() if line.startswith("error: ")] == [
        f"error: dataset '{bad}' (split train), given to grpo.py, has null in column 'prompt' at row 1; each prompt "
        'must be a string or a non-empty list of {"role": str, "content": str} messages; fix or drop that row']


def test_accumulation_given_twice_is_refused_before_the_accelerator_starts(tmp_path, monkeypatch):
    """accelerate would let the launcher's value (a DeepSpeed yaml's gradient_accumulation_steps) or a DeepSpeed
    json's replace the flag, while the scripts build their micro-batches by the flag: a mismatch is one line."""
    from common.runtime import setup

    flags = dict(seed=1, gradient_accumulation_steps=2, per_device_train_batch_size=4, max_grad_norm=1.0)
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "1")
    with pytest.raises(UserError, match=r"^--gradient_accumulation_steps is 2 but the accelerate launch config "
                                        r"\(ACCELERATE_GRADIENT_ACCUMULATION_STEPS, .*\) says 1; the script "
                                        r"accumulates"):
        setup(**flags)
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "2")  # equal: fine
    (tmp_path / "ds.json").write_text('{"gradient_accumulation_steps": 4, "zero_optimization": {"stage": 2}}')
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(tmp_path / "ds.json"))
    with pytest.raises(UserError,
                       match=f"^--gradient_accumulation_steps is 2 but the DeepSpeed config {tmp_path}/ds.json "
                                        "says 4; the script accumulates by its flag: make the two equal$"):
        setup(**flags)

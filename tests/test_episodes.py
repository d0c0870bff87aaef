"""common/episodes.py: multi-turn episodes with tools and environments, driven by a scripted stand-in
policy (fixed replies per turn) so that every token of an episode is known and worked out by hand here."""

import math
import os

import pytest
import torch

from common.episodes import call_tool, load_tools, parse_tool_calls, run_episodes
from common.generation import Samples, pad
from common.runtime import UserError
from tests.conftest import ROOT, script_args


@pytest.fixture()
def chat_tokenizer(tokenizer):
    """The tiny tokenizer with configs/chatml_tools.jinja, its turns ended by the tokenizer's EOS (the token the
    policy stops at), as SmolLM2's <|im_end|> is its EOS."""
    template = open(os.path.join(ROOT, "configs", "chatml_tools.jinja")).read()
    tokenizer.chat_template = template.replace("<|im_end|>", tokenizer.eos_token)
    return tokenizer


def scripted(tokenizer, replies: list[list[str]]):
    """A stand-in policy: episode e's turn k (from its seed: e + k * 2**48) is replies[e][k] then EOS, cut at
    the turn's token budget; records every call."""
    calls = []

    def sample(prompts, seeds, max_new_tokens, **options):
        calls.append(dict(prompts=prompts, seeds=seeds, max_new_tokens=max_new_tokens))
        out = []
        for seed in seeds:
            turns = replies[seed % 2**48]
            text = turns[seed // 2**48] if seed // 2**48 < len(turns) else "(a turn no episode here needs)"
            ids = tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
            out.append(ids[:max_new_tokens])
        ids, mask = pad(out, tokenizer.pad_token_id)
        ids, mask = (torch.nn.functional.pad(t, (0, max_new_tokens - t.shape[1])) for t in (ids, mask))
        return Samples(*pad(prompts, tokenizer.pad_token_id, "left"), ids, mask,
                       torch.tensor([o[-1] == tokenizer.eos_token_id for o in out]))
    return sample, calls


class Processes:
    """A stand-in accelerator for run_episodes' one collective: whether any process still has an episode going
    (`others`: what the other processes answer, turn by turn; none: this process alone)."""
    device = "cpu"

    def __init__(self, others=()):
        self.others = iter(others)

    def reduce(self, going, reduction):
        assert reduction == "max"
        return torch.maximum(going, torch.tensor(float(next(self.others, False))))


CALL = '<tool_call>\n{{"name": "multiply", "arguments": {{"a": {}, "b": {}}}}}\n</tool_call>'
ROW = {"prompt": [{"role": "user", "content": "What is 12 * 3 * 2?"}], "answer": "72"}


def glue(result: str, eos: str) -> str:
    """By hand, from configs/chatml_tools.jinja: after the assistant's end of turn, a user turn holding the
    result, then the next assistant header."""
    return f"\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response>{eos}\n<|im_start|>assistant\n"


@pytest.mark.parametrize("factory", ["Calculator", "make_calculator"])  # a class, or a function returning one
def test_a_three_turn_episode_token_by_token(chat_tokenizer, factory):
    tok, eos = chat_tokenizer, chat_tokenizer.eos_token
    tools = load_tools(tok, [], f"tests.toy_tools:{factory}", num_episodes=1)
    replies = [[CALL.format(12, 3), CALL.format(36, 2), "It is 72."]]
    sample, calls = scripted(tok, replies)
    episodes = run_episodes(sample, tok, [ROW], tools, seeds=[0], max_new_tokens=400, max_prompt_length=1000,
                            max_calls=None, prompt_ids=None, accelerator=Processes())
    s = episodes.samples
    n = int(s.completion_mask.sum())
    text = tok.decode(s.completion_ids[0, :n])
    # the whole episode: the model's three turns, each ended by EOS, and the two tool results between them
    assert text == (CALL.format(12, 3) + eos + glue("36", eos) + CALL.format(36, 2) + eos + glue("72", eos)
                    + "It is 72." + eos)
    learnt = tok.decode(s.completion_ids[0][s.model_mask[0].bool()])
    assert learnt == CALL.format(12, 3) + eos + CALL.format(36, 2) + eos + "It is 72." + eos
    assert s.model_mask[0, n:].sum() == 0 and s.completion_mask[0, n:].sum() == 0 and bool(s.finished[0])
    # the prompt: the tools' schemas in the system turn, reset's string after the question, the assistant header
    prompt = tok.decode(s.prompt_ids[0][s.prompt_mask[0].bool()])
    assert prompt.startswith("<|im_start|>system\n") and '"name": "multiply"' in prompt
    assert prompt.endswith("What is 12 * 3 * 2? (a calculator is available)" + eos + "\n<|im_start|>assistant\n")
    # each turn continues the episode so far, with its own seed
    assert [c["seeds"] for c in calls] == [[0], [2**48], [2 * 2**48]]
    assert calls[1]["prompts"][0] == s.prompt_ids[0][s.prompt_mask[0].bool()].tolist() + \
        s.completion_ids[0, :len(calls[1]["prompts"][0]) - int(s.prompt_mask[0].sum())].tolist()
    assert calls[2]["max_new_tokens"] == 400 - len(tok(text.split("It is 72.")[0], add_special_tokens=False).input_ids)
    # what reward functions get, as TRL passes it
    def function(a, b):
        return {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}
    assert episodes.completions == [[
        {"role": "assistant", "content": "", "tool_calls": [function(12, 3)]},
        {"role": "tool", "name": "multiply", "content": "36"},
        {"role": "assistant", "content": "", "tool_calls": [function(36, 2)]},
        {"role": "tool", "name": "multiply", "content": "72"},
        {"role": "assistant", "content": "It is 72."}]]
    assert episodes.turns.tolist() == [3] and episodes.calls.tolist() == [2] and episodes.failures.tolist() == [0]
    [(name, reward)] = tools.reward_functions()
    assert name == "Calculator" and reward(environments=tools.environments) == [2.0]


ENVIRONMENTS = ["calc=tests.toy_tools:Calculator", "capitals=tests.toy_tools:Capitals"]
LOOKUP = '<tool_call>\n{{"name": "capital", "arguments": {{"country": "{}"}}}}\n</tool_call>'


def test_several_environments_each_rows_own_instance_tools_reset_and_reward(chat_tokenizer):
    """Two named environments (TRL's dict environment_factory): each row's `environment` field picks one; its
    episode's prompt renders that environment's tools only, its calls go to its own instance, reset does not get
    the `environment` field, each class's get_reward scores its own episodes (None for the others); a second batch
    reuses the instances (more are made only when a batch needs more of one environment)."""
    tok = chat_tokenizer
    rows = [{**ROW, "environment": name} for name in ("calc", "capitals", "calc")]
    tools = load_tools(tok, [], ENVIRONMENTS, num_episodes=3, rows=rows)
    sample, calls = scripted(tok, [[CALL.format(2, 3), "6"], [LOOKUP.format("France"), "Paris"], ["42"]])
    episodes = run_episodes(sample, tok, rows, tools, seeds=[0, 1, 2], max_new_tokens=300, max_prompt_length=1000,
                            max_calls=None, prompt_ids=None, accelerator=Processes())
    prompts = [tok.decode(p) for p in calls[0]["prompts"]]
    assert ['"name": "multiply"' in p for p in prompts] == [True, False, True]
    assert ['"name": "capital"' in p for p in prompts] == [False, True, False]
    assert prompts[0].endswith("(a calculator is available)" + tok.eos_token + "\n<|im_start|>assistant\n")
    answers = [[m["content"] for m in c if m["role"] == "tool"] for c in episodes.completions]
    assert answers == [["6"], ["Paris"], []]
    calc, capitals, other = tools.environments
    assert [type(e).__name__ for e in tools.environments] == ["Calculator", "Capitals", "Calculator"]
    assert calc is not other and capitals.reset_with == ["answer", "prompt"]  # no `environment` for reset
    rewards = dict(tools.reward_functions())
    assert rewards["Calculator"](environments=tools.environments) == [1.0, None, 0.0]
    assert rewards["Capitals"](environments=tools.environments) == [None, 1.0, None]
    assert episodes.columns["environments"] == [calc, capitals, other]
    tools.assign([rows[1], rows[0], rows[1], rows[2]])  # the next batch: its instances, one more Capitals
    assert tools.environments[:3] == [capitals, calc, tools.pools["capitals"][1]] and tools.environments[3] is other
    assert {name: len(pool) for name, pool in tools.pools.items()} == {"calc": 2, "capitals": 2}


def test_a_factory_whose_environments_differ_in_class_renders_each_ones_tools(chat_tokenizer):
    """One factory, environments of two classes (any callable, as TRL takes): each episode's prompt renders its own
    environment's tools, and each class's get_reward is a reward source."""
    tools = load_tools(chat_tokenizer, [], ["tests.toy_tools:calculator_or_capitals"], num_episodes=2, rows=[ROW] * 2)
    tools.assign([ROW] * 2)
    assert [[s["function"]["name"] for s in tools.schemas_for(i)] for i in range(2)] == [["multiply"], ["capital"]]
    assert [name for name, _ in tools.reward_functions()] == ["Calculator", "Capitals"]


def test_an_unknown_or_unnamed_environment_is_one_error(chat_tokenizer):
    rows = [{**ROW, "environment": name} for name in ("calc", "maps")]
    with pytest.raises(UserError, match="rows name environments 'maps' that --environment_factory does not define "
                                        r"\(it defines calc, capitals;"):
        load_tools(chat_tokenizer, [], ENVIRONMENTS, num_episodes=2, rows=rows)
    with pytest.raises(UserError, match="rows name environments 'None' .* a run without a dataset"):  # rows: none
        load_tools(chat_tokenizer, [], ENVIRONMENTS, num_episodes=2, rows=[{"prompt": ROW["prompt"]}])
    with pytest.raises(UserError, match="several --environment_factory need a name each"):
        load_tools(chat_tokenizer, [], ["tests.toy_tools:Calculator", "capitals=tests.toy_tools:Capitals"], 2)
    tools = load_tools(chat_tokenizer, [], ENVIRONMENTS, num_episodes=2, rows=rows[:1])
    with pytest.raises(UserError, match="a row names environment 'maps'"):  # a row the start-up check did not see
        tools.assign(rows)


def test_failed_calls_are_answered_and_counted_and_episodes_end_as_they_should(chat_tokenizer):
    tok = chat_tokenizer
    tools = load_tools(tok, ["tests.toy_tools:multiply", "tests.toy_tools:broken"], None, num_episodes=5)
    replies = [['<tool_call>{"name": "multiply", "arguments": </tool_call>', "sorry"],  # does not parse
               ['<tool_call>{"name": "divide", "arguments": {"a": 1}}</tool_call>', "no"],  # unknown tool
               ['<tool_call>{"name": "multiply", "arguments": {"c": 1}}</tool_call>'
                '<tool_call>{"name": "broken", "arguments": {"x": 1}}</tool_call>', "hm"],  # misfit, raises
               [CALL.format(1, 2), CALL.format(2, 2), "4"],  # cut by max_calls after its first call turn
               ["one two three four five six seven eight nine ten " * 100]]  # never stops: truncated
    sample, _ = scripted(tok, replies)
    rows = [ROW] * 5
    episodes = run_episodes(sample, tok, rows, tools, seeds=list(range(5)), max_new_tokens=600, max_prompt_length=1000,
                            max_calls=1, prompt_ids=None, accelerator=Processes())
    answers = [[m["content"] for m in c if m["role"] == "tool"] for c in episodes.completions]
    assert answers[0] == ["{'error': 'could not parse the tool call {\"name\": \"multiply\", \"arguments\": "
                          "(JSONDecodeError: Expecting value: line 1 column 34 (char 33))'}"]
    assert answers[1] == ["{'error': 'Tool divide not found.'}"]
    assert "unexpected keyword argument 'c'" in answers[2][0] and answers[2][1] == "{'error': 'the tool is broken'}"
    assert answers[3] == ["2"]  # the second call turn ends the episode, its call not run
    assert episodes.calls.tolist() == [1, 1, 2, 1, 0] and episodes.failures.tolist() == [1, 1, 2, 0, 0]
    assert episodes.turns.tolist() == [2, 2, 2, 2, 1]
    assert episodes.samples.finished.tolist() == [True, True, True, True, False]
    assert episodes.samples.completion_mask[4].sum() == 600 == episodes.samples.model_mask[4].sum()


def test_a_tool_result_that_would_pass_the_length_limit_is_not_appended(chat_tokenizer):
    tok, eos = chat_tokenizer, chat_tokenizer.eos_token
    tools = load_tools(tok, ["tests.toy_tools:multiply"], None, num_episodes=1)
    call = tok(CALL.format(12, 3) + eos, add_special_tokens=False).input_ids
    room = len(call) + len(tok(glue("36", eos), add_special_tokens=False).input_ids)
    sample, calls = scripted(tok, [[CALL.format(12, 3), "36"]])
    episodes = run_episodes(sample, tok, [ROW], tools, seeds=[0], max_new_tokens=room, max_prompt_length=1000,
                            max_calls=None, prompt_ids=None, accelerator=Processes())
    s = episodes.samples
    assert len(calls) == 1 and not s.finished[0]  # no room for a reply after the result: truncated, one turn
    assert s.completion_mask[0].sum() == len(call) and s.completion_ids[0, :len(call)].tolist() == call
    assert [m["role"] for m in episodes.completions[0]] == ["assistant"] and episodes.calls.tolist() == [1]


def test_every_rank_samples_as_many_turns_as_the_longest_episode(chat_tokenizer):
    """Sharded decoding (ZeRO-3, FSDP2) needs every process in each generate call: a process whose episodes
    ended samples one dropped token per turn while another's go on."""
    tok = chat_tokenizer
    tools = load_tools(tok, ["tests.toy_tools:multiply"], None, num_episodes=1)
    sample, calls = scripted(tok, [["done"]])
    others = Processes([True, True, True, True, False])  # another process: 4 turns, this one 1
    episodes = run_episodes(sample, tok, [ROW], tools, seeds=[0], max_new_tokens=50, max_prompt_length=1000,
                            max_calls=None, prompt_ids=None, accelerator=others)
    assert len(calls) == 4 and [c["max_new_tokens"] for c in calls] == [50, 1, 1, 1]
    s = episodes.samples
    assert tok.decode(s.completion_ids[0][s.model_mask[0].bool()]) == "done" + tok.eos_token


def test_parsing_hermes_and_llama3_calls():
    assert parse_tool_calls('ok <tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', "hermes") == \
        ("ok", [{"name": "f", "arguments": {"x": 1}}])
    assert parse_tool_calls('{"name": "f", "parameters": {"x": 1}}', "llama3") == ("", [{"name": "f",
                                                                                         "arguments": {"x": 1}}])
    assert parse_tool_calls("no call here", "llama3") == ("no call here", [])
    assert call_tool({"f": lambda x: x + 1}, {"name": "f", "arguments": {"x": 1}}) == (
        {"role": "tool", "name": "f", "content": "2"}, False)


def test_a_template_that_renders_no_tools_is_one_error(tokenizer):
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(UserError, match="renders no tools; pass --chat_template_path"):
        load_tools(tokenizer, ["tests.toy_tools:multiply"], None, num_episodes=1)
    tokenizer.chat_template = "[INST] {{ tools }} {% for m in messages %}{{ m.content }}{% endfor %} [/INST]"
    with pytest.raises(UserError, match=r"tool calls in the chat template's format \(Mistral\) cannot be parsed"):
        load_tools(tokenizer, ["tests.toy_tools:multiply"], None, num_episodes=1)


# each family's template (tests/templates), its turn end, its call of multiply(12, 3), and what it writes after a
# turn's end for the tool result 36 up to the next assistant header, by hand from the template
QWEN_RESULT = "\n<|im_start|>user\n<tool_response>\n36\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
LLAMA_RESULT = ("<|start_header_id|>ipython<|end_header_id|>\n\n36<|eot_id|><|start_header_id|>assistant"
                "<|end_header_id|>\n\n")
FAMILIES = {
    "qwen2_5": ("<|im_end|>", CALL.format(12, 3), QWEN_RESULT),
    "qwen3": ("<|im_end|>", "<think>\nmultiply\n</think>\n\n" + CALL.format(12, 3), QWEN_RESULT),
    "qwen3_2507": ("<|im_end|>", CALL.format(12, 3), QWEN_RESULT),
    "qwen3_5": ("<|im_end|>", "Let me multiply.\n</think>\n\n<tool_call>\n<function=multiply>\n<parameter=a>\n12\n"
                "</parameter>\n<parameter=b>\n3\n</parameter>\n</function>\n</tool_call>", QWEN_RESULT + "<think>\n"),
    "llama3_1": ("<|eot_id|>", '{"name": "multiply", "parameters": {"a": 12, "b": 3}}', LLAMA_RESULT),
    "llama3_2": ("<|eot_id|>", '{"name": "multiply", "parameters": {"a": 12, "b": 3}}', LLAMA_RESULT),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_familys_template_is_tried_at_start_up_and_appends_tool_results_as_it_renders_them(tokenizer, family):
    """Each template's turn end is made the tokenizer's EOS (the token the scripted policy stops at). load_tools
    tries a tool turn at start-up; then an episode calls the tool and answers: its tokens are the model's call, the
    tool turn as the template writes it, then the answer. Qwen3's original renders the last assistant turn with an
    empty <think></think> and earlier ones without: before, that passed the start-up check and ended the run at the
    first tool call ("renders a conversation's start differently")."""
    end, call, result = FAMILIES[family]
    tok, eos = tokenizer, end
    tok.add_special_tokens({"eos_token": end})
    tok.chat_template = open(os.path.join(ROOT, "tests", "templates", family + ".jinja")).read()
    tools = load_tools(tok, ["tests.toy_tools:multiply"], None, num_episodes=1)
    sample, _ = scripted(tok, [[call, "It is 36."]])
    episodes = run_episodes(sample, tok, [ROW], tools, seeds=[0], max_new_tokens=300, max_prompt_length=1000,
                            max_calls=None, prompt_ids=None, accelerator=Processes())
    s = episodes.samples
    text = tok.decode(s.completion_ids[0, :int(s.completion_mask[0].sum())])
    assert text == call + eos + result + "It is 36." + eos
    assert [m["content"] for m in episodes.completions[0] if m["role"] == "tool"] == ["36"]
    assert episodes.calls.tolist() == [1] and episodes.failures.tolist() == [0] and s.finished.tolist() == [True]


def test_a_template_that_ends_a_turn_differently_before_tool_results_is_refused_at_start_up(tokenizer):
    tokenizer.chat_template = (  # <|im_end|> after the last assistant turn, <|end|> after an earlier one
        "{% if tools %}<tool_call> {{ tools | tojson }}{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{{ m.content }}{{ '<|end|>' if m.role == 'assistant' and not loop.last else '<|im_end|>' }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(UserError, match="ends an assistant turn differently once tool results follow"):
        load_tools(tokenizer, ["tests.toy_tools:multiply"], None, num_episodes=1)


def test_episodes_with_different_room_left_share_a_call_and_each_is_cut_at_its_own_room(chat_tokenizer):
    """Three episodes in one sampling call: after the first turn one has answered, the other two called the tool
    with calls of different lengths, so their room differs. The second turn is sampled with the larger room; the
    episode with less room keeps only its room's tokens of its reply and is not finished (truncated), though the
    sampler stopped within the larger room; the other's reply fits and ends it."""
    tok, eos = chat_tokenizer, chat_tokenizer.eos_token
    tools = load_tools(tok, ["tests.toy_tools:multiply"], None, num_episodes=3)
    long_call, short_call = CALL.format(123456789, 987654321), CALL.format(1, 2)
    reply = "The product is large, as you can see here."
    sample, calls = scripted(tok, [[long_call, reply], [short_call, reply], ["done"]])
    n = lambda text: len(tok(text, add_special_tokens=False).input_ids)  # noqa: E731
    used = [n(long_call + eos + glue("121932631112635269", eos)), n(short_call + eos + glue("2", eos))]
    budget = used[0] + n(reply + eos) - 3  # episode 0 has 3 tokens too few for its reply, episode 1 enough
    assert used[1] + 3 <= used[0]
    episodes = run_episodes(sample, tok, [ROW] * 3, tools, seeds=[0, 1, 2], max_new_tokens=budget,
                            max_prompt_length=1000, max_calls=None, prompt_ids=None, accelerator=Processes())
    s = episodes.samples
    assert [c["max_new_tokens"] for c in calls] == [budget, budget - used[1]]  # the larger room of the two
    assert len(calls[1]["prompts"]) == 2  # the episode that answered is not sampled again
    assert s.finished.tolist() == [False, True, True] and episodes.turns.tolist() == [2, 2, 1]
    assert s.completion_mask.sum(1).tolist() == [budget, used[1] + n(reply + eos), n("done" + eos)]
    assert s.model_mask[0].sum() == n(long_call + eos) + n(reply + eos) - 3  # its reply cut at its room
    assert tok.decode(s.completion_ids[1][s.model_mask[1].bool()]) == short_call + eos + reply + eos


def test_a_tool_that_hangs_answers_an_error_after_the_timeout_and_a_huge_result_is_cut_before_tokenising(
        chat_tokenizer, monkeypatch):
    """--tool_timeout: a tool that does not answer within it is answered as failed (counted) and the episode goes
    on; a result far longer than the room left is cut before it is tokenised, and the episode is truncated."""
    import threading
    import time
    tok, release = chat_tokenizer, threading.Event()

    def hang():
        release.wait(20)

    def multiply(a: int, b: int):
        return "9" * 10**7  # ~10 MB of text

    tools = load_tools(tok, ["tests.toy_tools:multiply"], None, num_episodes=2, timeout=0.5)
    tools.functions = [multiply, hang]
    hang_call = '<tool_call>{"name": "hang", "arguments": {}}</tool_call>'
    sample, _ = scripted(tok, [[hang_call, "too slow"], [CALL.format(1, 2), "never"]])
    huge = []
    real_tokenizer_call = type(tok).__call__
    monkeypatch.setattr(type(tok), "__call__", lambda self, text, *a, **k: (
        huge.append(len(text)) if isinstance(text, str) and len(text) > 1000 else None,
        real_tokenizer_call(self, text, *a, **k))[1])
    start = time.time()
    episodes = run_episodes(sample, tok, [ROW] * 2, tools, seeds=[0, 1], max_new_tokens=200, max_prompt_length=1000,
                            max_calls=None, prompt_ids=None, accelerator=Processes())
    release.set()
    assert time.time() - start < 10
    assert episodes.completions[0][1]["content"] == ("{'error': 'tool hang did not answer within 0.5 s "
                                                     "(--tool_timeout)'}")
    assert episodes.failures.tolist() == [1, 0] and episodes.calls.tolist() == [1, 1]
    assert episodes.samples.finished.tolist() == [True, False] and episodes.turns.tolist() == [2, 1]
    assert huge == []  # nothing of the huge result was tokenised


def test_async_tools_environment_methods_and_get_reward_are_awaited_on_the_runs_one_loop(chat_tokenizer):
    """TRL awaits async tools, an environment's async methods and its async get_reward; here too, each on the run's
    event loop (common/event_loop.py: one loop, so a client one of them keeps stays on the loop it was made on),
    called in place (--tool_timeout 0) or in a thread of its own; one that does not answer in time is answered
    as failed."""
    from tests import toy_tools
    tok, toy_tools.LOOPS[:] = chat_tokenizer, []
    call = '<tool_call>{{"name": "{}", "arguments": {}}}</tool_call>'
    turns = {0.0: [[call.format("add_later", '{"a": 2, "b": 3}'), "5"], [call.format("deposit", '{"amount": 7}'), "7"]],
             0.3: [[call.format("never_answers", "{}"), "?"], [call.format("deposit", '{"amount": 4}'), "4"]]}
    for timeout, replies in turns.items():
        tools = load_tools(tok, ["tests.toy_tools:add_later", "tests.toy_tools:never_answers"],
                           ["tests.toy_tools:AsyncLedger"], num_episodes=2, rows=[ROW] * 2, timeout=timeout)
        sample, _ = scripted(tok, replies)
        episodes = run_episodes(sample, tok, [ROW] * 2, tools, seeds=[0, 1], max_new_tokens=200,
                                max_prompt_length=1000, max_calls=None, prompt_ids=None, accelerator=Processes())
        answers = [[m["content"] for m in c if m["role"] == "tool"] for c in episodes.completions]
        rewards = dict(tools.reward_functions())["AsyncLedger"](environments=tools.environments)
        if timeout == 0.0:
            assert answers == [["5"], ["7"]] and episodes.failures.tolist() == [0, 0] and rewards == [0.0, 7.0]
        else:
            assert answers == [["{'error': 'tool never_answers did not answer within 0.3 s (--tool_timeout)'}"],
                               ["4"]]
            assert episodes.failures.tolist() == [1, 0] and rewards == [0.0, 4.0]
    assert len(toy_tools.LOOPS) == 7 and len(set(map(id, toy_tools.LOOPS))) == 1  # calls 2 + 1, get_reward 2 + 2


def test_an_environment_factory_or_reset_that_raises_or_hangs_ends_in_one_line_naming_it(chat_tokenizer, monkeypatch):
    """An environment's factory and reset(**row) are the user's code too: what they raise is one line naming
    them, and one that has not returned within --tool_timeout ends the run with one line (common.rewards.called's
    watchdog; its exit_now is recorded here, and lets the call return). --tool_timeout 0: no limit, a slow reset is
    waited for."""
    import time

    from common import rewards
    from tests import toy_tools
    tok, ended = chat_tokenizer, []
    monkeypatch.setattr(rewards, "exit_now", lambda line: (ended.append(line), toy_tools.RESET_RELEASE.set()))

    def episodes_with(environment: str, timeout: float):
        toy_tools.RESET_RELEASE.clear()
        tools = load_tools(tok, [], [f"tests.toy_tools:{environment}"], num_episodes=2, rows=[ROW] * 2,
                           timeout=timeout)
        sample, _ = scripted(tok, [["72"], ["72"]])
        return run_episodes(sample, tok, [ROW] * 2, tools, seeds=[0, 1], max_new_tokens=50, max_prompt_length=1000,
                            max_calls=None, prompt_ids=None, accelerator=Processes())

    with pytest.raises(UserError, match=r"^environment 'ResetRaises.reset' raised ValueError: no task for 72$"):
        episodes_with("ResetRaises", 5.0)
    start = time.time()
    episodes_with("SlowReset", 0.3)
    assert ended == ["environment 'SlowReset.reset' ran past --tool_timeout (0.3 s)"]
    assert time.time() - start < 1.5  # the watchdog fired at 0.3 s, the second reset found the release set (else 2 s)
    start = time.time()
    episodes = episodes_with("SlowReset", 0.0)
    assert len(ended) == 1 and time.time() - start >= 2.0  # no limit: each reset took its second
    assert episodes.prompts[1][-1]["content"].endswith("(a calculator is available)")
    factory = "^environment factory 'broken_factory' raised RuntimeError: no calculator today$"
    with pytest.raises(UserError, match=factory):  # at start-up
        load_tools(tok, [], ["tests.toy_tools:broken_factory"], num_episodes=2, rows=[ROW] * 2, timeout=5.0)
    tools = load_tools(tok, [], ENVIRONMENTS, num_episodes=2, rows=[{**ROW, "environment": "calc"}], timeout=5.0)
    tools.factories["calc"] = toy_tools.broken_factory
    with pytest.raises(UserError, match=factory):  # a batch needing one more of an environment than made so far
        tools.assign([{**ROW, "environment": "calc"}] * 2)
    toy_tools.RESET_RELEASE.clear()
    load_tools(tok, [], ["tests.toy_tools:slow_factory"], num_episodes=1, rows=[ROW], timeout=0.3)
    assert ended[1:] == ["environment factory 'slow_factory' ran past --tool_timeout (0.3 s)"]


def test_an_error_line_carries_the_rank_when_there_are_several_processes(monkeypatch, capsys):
    from common.runtime import exit_on_user_error
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr("common.runtime.end_processes", lambda: None)
    with pytest.raises(SystemExit) as stopped, exit_on_user_error():
        raise UserError("--tool_timeout must be >= 0 seconds (got -1; 0: no limit)")
    assert stopped.value.code == 2
    assert capsys.readouterr().err == "[rank 1] error: --tool_timeout must be >= 0 seconds (got -1; 0: no limit)\n"
    with pytest.raises(ZeroDivisionError), exit_on_user_error():
        1 / 0
    assert capsys.readouterr().err == "[rank 1] error: ZeroDivisionError: division by zero (traceback below)\n"
    # each line goes out in one write (stderr writes through): two ranks' lines never share a line (CI, 7f968f7)
    writes = []
    monkeypatch.setattr("sys.stderr", type("Err", (), {"write": lambda self, s: writes.append(s)})())
    with pytest.raises(SystemExit), exit_on_user_error():
        raise UserError("no")
    assert writes == ["[rank 1] error: no\n"]


TURNS = {0: ["42"], 1: [CALL.format(2, 3), "6"], 2: [CALL.format(2, 3), CALL.format(6, 2), "12"]}  # 0, 1, 2 calls


@pytest.mark.parametrize("script", ["grpo", "rloo"])
def test_without_a_dataset_each_prompt_is_what_reset_returns_and_max_steps_ends_the_run(tmp_path, tiny_model,
                                                                                         monkeypatch, capsys, script):
    """`--dataset_name ""` with an environment that owns its data (TRL's): each episode's prompt is one user message,
    the string its environment's reset() returned (here a new task each time), which reward functions and the
    samples table see too; the rewards are the environment's; --max_steps ends the run. Episode e asks multiply
    its own task's factors when e is even."""
    import importlib

    from common.models import load_tokenizer
    from tests import toy_rewards, toy_tools
    from tests.test_sft import read_log

    module = importlib.import_module(f"algos.{script}")
    template = tmp_path / "template.jinja"
    template.write_text(open(os.path.join(ROOT, "configs", "chatml_tools.jinja")).read().replace(
        "<|im_end|>", "<|endoftext|>"))
    group = dict(num_generations=2) if script == "grpo" else dict(rloo_k=2)
    args = script_args(module.Args, model_name_or_path=tiny_model, dataset_name="", chat_template_path=str(template),
                       environment_factory="tests.toy_tools:Quiz", reward_model_paths=[], max_completion_length=300,
                       reward_funcs=["tests.toy_rewards:record_prompts"], reward_weights=[0.0], eval_steps=1,
                       per_device_train_batch_size=4, max_steps=2, output_dir=str(tmp_path / "out"), **group)
    tokenizer = load_tokenizer(tiny_model, chat_template_path=str(template))
    sample, calls = scripted(tokenizer, [[CALL.format(e + 1, e + 2), "done"] if e % 2 == 0 else ["no idea"]
                                         for e in range(8)])
    monkeypatch.setattr(module, "generate", lambda model, tok, prompts, max_new_tokens, seeds, **_: sample(
        prompts, [s - args.seed * 10**9 for s in seeds], max_new_tokens))
    monkeypatch.setattr(toy_tools.Quiz, "asked", 0)
    toy_rewards.PROMPTS.clear()
    module.main(args)
    first_turns = [tokenizer.decode(p) for c in calls if max(c["seeds"]) < 2**48 for p in c["prompts"]]
    assert [text.split("<|im_start|>user\n")[1].split(tokenizer.eos_token)[0] for text in first_turns] == [
        f"What is {e + 1} * {e + 2}?" for e in range(8)]
    log = read_log(str(tmp_path / "out"))
    assert [row["rewards/Quiz/mean"] for row in log] == [0.5, 0.5]
    assert [p for batch in toy_rewards.PROMPTS for p in batch] == [
        [{"role": "user", "content": f"What is {e + 1} * {e + 2}?"}] for e in range(8)]
    assert "prompt: user: What is 5 * 6?" in capsys.readouterr().out  # step 2's first sample


def test_no_dataset_needs_an_environment(tmp_path, tiny_model):
    """`--dataset_name ""` without an environment: one error line before anything loads (with several, the rows
    have no `environment` field: test_an_unknown_or_unnamed_environment_is_one_error); gkd.py reads a dataset
    always."""
    from algos import gkd, grpo, online_dpo

    for module in (grpo, online_dpo):  # online_dpo: no environments at all
        with pytest.raises(UserError, match='^--dataset_name "": no dataset, in grpo/rloo with an --environment_fac'):
            module.main(script_args(module.Args, dataset_name="", output_dir=str(tmp_path)))
    with pytest.raises(UserError, match="^gkd.py reads its prompts from a dataset"):
        gkd.main(script_args(gkd.Args, model_name_or_path=tiny_model, teacher_model_name_or_path=tiny_model,
                             dataset_name="", environment_factory=["tests.toy_tools:Calculator"], lmbda=1.0,
                             output_dir=str(tmp_path)))


def scripted_first_step(module, tmp_path, tiny_model, monkeypatch, **options):
    """module's first step with --environment_factory Calculator, episode j's turns TURNS[j % 3] (so its reward,
    the number of calls, differs within each group), a perturbed reference (gkd: teacher): (the gradient record,
    the policy at the recorded weights, the reference, and per episode its prompt ids, its pieces [(ids, the
    model's?)] worked out by hand, and its reward)."""
    from tests.first_step import gradients_before_clipping, perturbed_reference, policy_with, weights_of, write_splits
    from common.models import load_tokenizer

    template = tmp_path / "template.jinja"
    template.write_text(open(os.path.join(ROOT, "configs", "chatml_tools.jinja")).read().replace(
        "<|im_end|>", "<|endoftext|>"))
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} * 3 * 2?"}]} for i in range(4)]
    lengths = (dict(teacher_model_name_or_path=tiny_model, max_new_tokens=300) if module.__name__ == "algos.gkd" else
               dict(reward_model_paths=[], max_completion_length=300))
    args = script_args(module.Args, model_name_or_path=tiny_model, dataset_name=write_splits(tmp_path / "data", rows),
                       environment_factory="tests.toy_tools:Calculator", chat_template_path=str(template),
                       output_dir=str(tmp_path / "out"), **lengths, **options)
    tokenizer = load_tokenizer(tiny_model, chat_template_path=str(template))
    n = args.per_device_train_batch_size
    sample, calls = scripted(tokenizer, [TURNS[j % 3] for j in range(n)])

    def generate(model, tok, prompts, max_new_tokens, seeds, **_):
        return sample(prompts, [s - args.seed * 10**9 for s in seeds], max_new_tokens)  # episodes 0..n-1 by seed
    monkeypatch.setattr(module, "generate", generate)
    loaded = perturbed_reference(monkeypatch, module)
    (record,) = gradients_before_clipping(monkeypatch, module.main, args)
    policy = policy_with(tiny_model, tokenizer, weights_of(record))
    prompts = calls[0]["prompts"]  # what the policy saw first: the schemas, the question, reset's string
    eos = tokenizer.eos_token
    assert all(tokenizer.decode(p).endswith("(a calculator is available)" + eos + "\n<|im_start|>assistant\n")
               for p in prompts)
    # by hand: each episode's tokens, the model's turns (learnt) and the results between them (not)
    results, episodes = {CALL.format(2, 3): "6", CALL.format(6, 2): "12"}, []
    for j in range(n):
        pieces = []
        for text in TURNS[j % 3]:
            pieces.append((tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id], True))
            if text in results:
                pieces.append((tokenizer(glue(results[text], eos), add_special_tokens=False).input_ids, False))
        episodes.append(pieces)
    return args, record, policy, loaded[1], prompts, episodes, [float(len(TURNS[j % 3]) - 1) for j in range(n)]


def episode_logps(model, prompt, pieces):
    """(log pi of every token of the episode after the prompt, one plain forward; 1 on the model's tokens)."""
    from tests.first_step import own_logprobs

    completion = [t for ids, _ in pieces for t in ids]
    return own_logprobs(model, prompt, completion), torch.tensor([float(own) for ids, own in pieces for _ in ids])


@pytest.mark.parametrize("padding_free", [False, pytest.param(True, marks=pytest.mark.long)],  # long: lane 1
                         ids=["padded", "padding_free"])
def test_grpo_first_step_trains_the_models_tokens_of_each_episode_only(tmp_path, tiny_model, monkeypatch,
                                                                         padding_free):
    """grpo.py at its defaults with --environment_factory and a scripted policy: the gradient of its first step
    against the loss written out here over each episode's own tokens, read by one plain forward of the whole
    episode; tool results and the template's text around them carry no loss, no KL term and no count in the
    normaliser. A KL or policy-gradient term over the tool tokens, or a shifted position, fails. With
    --padding_free the episodes' passes are packed (common/packing.py), under the same masks."""
    import statistics

    from algos import grpo
    from tests.first_step import assert_gradient, gradient, grads_of

    from tests import toy_rewards

    toy_rewards.IDS.clear()  # a reward function of weight 0 that notes its completion_ids: TRL's, tool results too
    args, record, policy, ref, prompts, episodes, rewards = scripted_first_step(
        grpo, tmp_path, tiny_model, monkeypatch, per_device_train_batch_size=16, padding_free=padding_free,
        reward_funcs=["tests.toy_rewards:record_ids"], reward_weights=[0.0])
    assert toy_rewards.IDS == [[[t for ids, _ in pieces for t in ids] for pieces in episodes]]
    advantages = []
    for g in range(0, len(rewards), args.num_generations):
        group = rewards[g:g + args.num_generations]
        advantages += [(r - statistics.mean(group)) / (statistics.stdev(group) + 1e-4) for r in group]
    tokens = sum(len(ids) for pieces in episodes for ids, own in pieces if own)
    pg = kl = 0.0
    for p, pieces, a in zip(prompts, episodes, advantages):
        logps, own = episode_logps(policy, p, pieces)
        with torch.no_grad():
            ref_logps, _ = episode_logps(ref, p, pieces)
        q = ref_logps - logps
        pg = pg - a * (logps * own).sum() / tokens
        kl = kl + args.beta * ((q.exp() - q - 1) * own).sum() / tokens
    assert_gradient(grads_of(record), {"policy gradient": gradient(pg, policy), "kl": gradient(kl, policy)})


def test_rloo_first_step_trains_the_models_tokens_of_each_episode_only(tmp_path, tiny_model, monkeypatch):
    """rloo.py at its defaults with --environment_factory and a scripted policy: A_i = R_i - the mean R of the
    other episodes of its prompt, R = score - kl_coef * sum of KL over the model's tokens only, and the gradient
    -A grad log pi over those tokens, divided by their count; the score's and the KL penalty's parts checked."""
    import statistics

    from algos import rloo
    from tests.first_step import assert_gradient, gradient, grads_of

    from tests import toy_rewards

    toy_rewards.IDS.clear()  # as grpo's: the whole episode's completion_ids (TRL's)
    args, record, policy, ref, prompts, episodes, scores = scripted_first_step(
        rloo, tmp_path, tiny_model, monkeypatch, per_device_train_batch_size=12,
        reward_funcs=["tests.toy_rewards:record_ids"], reward_weights=[0.0])
    assert toy_rewards.IDS == [[[t for ids, _ in pieces for t in ids] for pieces in episodes]]
    logps, own = zip(*(episode_logps(policy, p, pieces) for p, pieces in zip(prompts, episodes)))
    with torch.no_grad():
        kl = [((lp.detach() - episode_logps(ref, p, pieces)[0]) * m).sum().item()
              for lp, m, p, pieces in zip(logps, own, prompts, episodes)]
    k, tokens = args.rloo_k, sum(m.sum().item() for m in own)
    terms = {"score": 0.0, "kl penalty": 0.0}
    for i in range(len(scores)):
        others = [j for j in range(i - i % k, i - i % k + k) if j != i]
        a_score = scores[i] - statistics.mean(scores[j] for j in others)
        a_kl = -args.kl_coef * (kl[i] - statistics.mean(kl[j] for j in others))
        terms["score"] = terms["score"] - a_score * (logps[i] * own[i]).sum() / tokens
        terms["kl penalty"] = terms["kl penalty"] - a_kl * (logps[i] * own[i]).sum() / tokens
    assert_gradient(grads_of(record), {name: gradient(t, policy) for name, t in terms.items()})


@pytest.mark.parametrize("padding_free", [False, pytest.param(True, marks=pytest.mark.long)],  # long: lane 1
                         ids=["padded", "padding_free"])
def test_gkd_first_step_distils_the_students_tokens_of_each_episode_only(tmp_path, tiny_model, monkeypatch,
                                                                        padding_free):
    """gkd.py with --environment_factory and a scripted student, beta 0.3 against a perturbed teacher: the gradient
    of its first step against D_beta written out here from its definition, at each of the student's own tokens of
    each episode (logits from one plain forward of the whole episode, in float64), summed and divided by the
    count of those tokens; tool results and the template's text around them are context for both models, graded
    nowhere. A divergence over the tool tokens, a shifted position or a count with them in it fails. With
    --padding_free both models' passes are packed (common/packing.py), under the same masks."""
    from algos import gkd
    from tests.first_step import assert_gradient, gradient, grads_of

    args, record, student, teacher, prompts, episodes, _ = scripted_first_step(
        gkd, tmp_path, tiny_model, monkeypatch, per_device_train_batch_size=4, beta=0.3, lmbda=1.0,
        padding_free=padding_free)
    beta, tokens, loss = args.beta, sum(len(ids) for pieces in episodes for ids, own in pieces if own), 0.0
    for p, pieces in zip(prompts, episodes):
        completion = torch.tensor([p + [t for ids, _ in pieces for t in ids]])
        own = torch.tensor([float(own) for ids, own in pieces for _ in ids])
        q = student(completion).logits[0, len(p) - 1:-1].double().log_softmax(-1)  # the student, Q
        with torch.no_grad():
            t = teacher(completion).logits[0, len(p) - 1:-1].double().log_softmax(-1)  # the teacher, P
        m = torch.logsumexp(torch.stack([t + math.log(beta), q + math.log(1 - beta)]), 0)
        kl_p_m, kl_q_m = (t.exp() * (t - m)).sum(-1), (q.exp() * (q - m)).sum(-1)
        loss = loss + ((beta * kl_p_m + (1 - beta) * kl_q_m) / (beta * (1 - beta)) * own).sum() / tokens
    assert any(not own for pieces in episodes for _, own in pieces)  # tool results in the episodes, not graded
    assert_gradient(grads_of(record), {"divergence": gradient(loss, student)})


@pytest.mark.multiproc
@pytest.mark.parametrize("script", ["grpo", "rloo", "gkd"])
def test_two_processes_with_episodes_of_different_lengths_match_one_process(tmp_path, tiny_model, sft_model, script):
    """2 gloo processes whose episodes take different numbers of turns (tests/scripted_episodes.py) against 1
    process with 2 micro-batches: every rank samples as many turns, the same logged values (gkd: the tiny base
    model distilled from the SFT model, so that the divergence is not 0)."""
    import json

    from tests.conftest import run_script
    from tests.test_multiprocess import TWO_PROCESSES
    from tests.test_sft import read_log

    size = ["--per_device_train_batch_size", "8"] + {"grpo": ["--num_generations", "8"], "rloo": ["--rloo_k", "4"],
                                                      "gkd": ["--beta", "0.3"]}[script]
    flags = [*scripted_flags(tmp_path, tiny_model, script, teacher=sft_model), "--max_steps", "2", "--logging_steps",
             "1", *size]
    run_script(*flags, "--gradient_accumulation_steps", "1", "--output_dir", str(tmp_path / "two"),
               launcher=TWO_PROCESSES, env={**os.environ, "ACCELERATE_USE_CPU": "true"})
    run_script(*flags, "--gradient_accumulation_steps", "2", "--output_dir", str(tmp_path / "one"))
    two, one = read_log(str(tmp_path / "two")), read_log(str(tmp_path / "one"))
    assert len(two) == len(one) == 2 and one[0]["episodes/turns_max"] == 3 and one[0]["tools/call_frequency"] > 0.5
    for a, b in zip(two, one):
        for key in ("tools/call_frequency", "episodes/turns_mean", "episodes/turns_max"):
            assert a[key] == b[key], (key, a[key], b[key])
        loss = {"grpo": "loss", "rloo": "loss/policy_avg", "gkd": "loss"}[script]
        assert a[loss] == pytest.approx(b[loss], abs=1e-5), json.dumps([a, b])
        if script == "gkd":
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5) and a["loss"] > 0


def scripted_flags(tmp_path, tiny_model, script: str, teacher: str | None = None) -> list[str]:
    """tests/scripted_episodes.py's command line for `script` on a conversational set (4 prompts; gkd, which takes
    a batch's prompts without repeats: 16) with the calculator environment and the test template (EOS ends a
    turn)."""
    from tests.first_step import write_splits

    template = tmp_path / "template.jinja"
    template.write_text(open(os.path.join(ROOT, "configs", "chatml_tools.jinja")).read().replace(
        "<|im_end|>", "<|endoftext|>"))
    gkd = script == "gkd"
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} * 3 * 2?"}]} for i in range(16 if gkd else 4)]
    lengths = (["--teacher_model_name_or_path", teacher or tiny_model, "--max_new_tokens", "300"] if gkd else
               ["--reward_model_paths", "--max_completion_length", "300"])
    return ["tests/scripted_episodes.py", script, "--model_name_or_path", tiny_model, "--dataset_name",
            write_splits(tmp_path / "data", rows), "--environment_factory", "tests.toy_tools:Calculator",
            "--chat_template_path", str(template), *lengths]


@pytest.mark.resume
def test_sigterm_then_resume_with_episodes_equals_an_uninterrupted_run(tmp_path, tiny_model):
    """grpo with episodes and 2 iterations per rollout (a stop may fall between them, with the rollout's episode
    statistics in the checkpoint): SIGTERM after the first logged step, resume from `latest`, and the weights
    and logged values equal the uninterrupted run's."""
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import run_script
    from tests.test_common_checkpoint import records, weights

    flags = [*scripted_flags(tmp_path, tiny_model, "grpo"), "--per_device_train_batch_size", "16",
             "--num_iterations", "2", "--max_steps", "8", "--logging_steps", "1", "--run_name", "r"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    run_script(*flags, "--output_dir", str(full))
    proc = subprocess.Popen([sys.executable, *flags, "--output_dir", str(cut)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    log, deadline = cut / "logs" / "r.jsonl", time.time() + 300
    while not (log.exists() and log.read_text().strip()) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    run_script(*flags, "--output_dir", str(cut), "--resume_from_checkpoint", "latest")
    a, b = weights(full), weights(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert records(cut) == records(full) and records(full)[0]["episodes/turns_max"] == 3

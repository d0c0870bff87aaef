"""Multi-turn episodes for the online scripts (--tools, --environment_factory), in the contract of TRL's GRPO
trainer: the model writes a turn; the tool calls in it (parsed in the chat template's format) run as
`fn(**arguments)` and come back as {"role": "tool", "name", "content": str(result)} messages (a failure, or a tool
that has not answered within --tool_timeout seconds, as str({"error": ...}), counted, never a crash or a hang);
then the model writes its next turn. A turn without a call ends the episode, as do --max_tool_calling_iterations
turns with calls, and the episode's tokens reaching max_completion_length (a tool result that would pass it is not
appended, and the episode counts as truncated).
Only the model's own tokens are trained (`Samples.model_mask`); tool results and the template's text around them
are context."""

import inspect
import json
import re
import threading
from dataclasses import dataclass, field, replace

import torch
import tyro
from transformers.utils import get_json_schema

from common.data import as_completions, encode_prompt, is_conversational, without_nulls
from common.event_loop import resolved
from common.generation import Samples, pad
from common.rewards import called, import_function
from common.runtime import UserError

HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)  # ChatML / Qwen / Hermes templates
# Qwen3-Coder / Qwen3.5 write a call's body as <function=name> then <parameter=argument>value</parameter> lines
XML_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


@tyro.conf.configure(tyro.conf.OmitArgPrefixes)  # --tools, not --episodes.tools
@dataclass
class EpisodeArgs:
    """multi-turn episodes with tools and environments (common/episodes.py)"""
    tools: list[str] = field(default_factory=list)
    """functions `module:function` the model may call (type hints, Google-style docstring; TRL's tools=)"""
    environment_factory: list[str] = field(default_factory=list)
    """`module:Class` (or a function making one), one per episode: reset(**row); other methods: tools, get_reward();
    several: `name=module:Class ...`, each row's `environment` field naming its own (TRL's dict)"""
    max_tool_calling_iterations: int | None = None
    """turns with tool calls per episode (None: until a turn without one or max_completion_length tokens)"""
    tool_timeout: float = 60.0
    """seconds a tool call may take, else it answers an error (counted as failed); 0: no limit, in the calling thread.
    An environment's factory and reset() get as long, else the run ends with one line saying so"""


@dataclass
class Tools:
    """The functions the model may call, their JSON schemas (rendered by the chat template), and the environments:
    one instance per episode of a batch, from a pool per environment (reset before each episode; its public
    methods are tools bound to it, rendered in its episode's prompt only)."""
    functions: list
    schemas: dict  # the JSON schemas of the functions (key None) and of each environment class's methods
    call_format: str  # "hermes" (<tool_call>{...}</tool_call>) or "llama3" (a bare JSON object)
    factories: dict = field(default_factory=dict)  # environment name -> factory (None: the only one, unnamed)
    pools: dict = field(default_factory=dict)  # environment name -> the instances made so far
    environments: list | None = None  # this batch's, one per episode (`assign`)
    timeout: float | None = None  # seconds a call may take (--tool_timeout); None: no limit, called in place

    def assign(self, rows: list[dict]):
        """An environment instance for each row's episode: the row's `environment` field names it when there are
        several (TRL's dict), the k-th episode of an environment in a batch gets its pool's k-th instance."""
        self.environments, taken = [], {}
        for row in rows:
            name = row.get("environment") if None not in self.factories else None
            if name not in self.factories:
                raise UserError(f"a row names environment {name!r}, which --environment_factory does not define "
                                f"(it defines {', '.join(map(str, self.factories))})")
            pool, taken[name] = self.pools.setdefault(name, []), taken.get(name, -1) + 1
            if taken[name] == len(pool):
                pool.append(made(self.factories[name], self.timeout))
            self.environments.append(pool[taken[name]])

    def schemas_for(self, i: int) -> list:
        """The schemas episode i's prompt renders: the functions' and its own environment's methods'."""
        return self.schemas[None] + (self.schemas[type(self.environments[i])] if self.environments else [])

    def reward_functions(self) -> list:
        """[(an environment class's name, a reward function calling get_reward() of each episode's environment of
        that class, None for the others)] for each class that has one."""
        return [(cls.__name__, lambda environments, _cls=cls, **_: [resolved(e.get_reward()) if type(e) is _cls
                                                                     else None for e in environments])
                for cls in self.schemas if cls is not None and callable(getattr(cls, "get_reward", None))]

    def for_episode(self, i: int) -> dict:
        """name -> callable for episode i: the plain functions and its environment's methods."""
        env = self.environments[i] if self.environments else None
        return {f.__name__: f for f in self.functions} | ({name: getattr(env, name) for name in
                                                           environment_methods(type(env))} if env else {})


def made(factory, timeout: float | None):
    """An environment from the user's factory: what it raises is one line naming it, and a factory that has not
    returned within --tool_timeout seconds ends the run with one (common.rewards.called)."""
    return called(getattr(factory, "__qualname__", str(factory)), factory, {}, timeout or 0,
                  what="environment factory", flag="--tool_timeout")


def environment_methods(cls) -> list[str]:
    """An environment's tools: every public method but reset and get_reward (TRL's rule)."""
    return [n for n, f in inspect.getmembers(cls, inspect.isfunction)
            if not n.startswith("_") and n not in ("reset", "get_reward")]


def schema(fn, where: str) -> dict:
    try:
        return get_json_schema(fn)
    except Exception as e:  # transformers' TypeHintParsingException / DocstringParsingException
        raise UserError(f"tool {where} has no usable schema ({e}); give every argument a type hint and the "
                        "docstring a Google-style Args: section") from None


def load_tools(tokenizer, function_specs: list[str], environment_factory: str | None, num_episodes: int,
               rows: list[dict] = (), dynamic_sampling: bool = False, timeout: float | None = None) -> Tools:
    """--tools and --environment_factory checked against the chat template (it must render tools, in a format
    whose calls can be parsed, and tool results after a turn as an episode appends them: `tool_turn_text`) and the
    data (conversational prompts); else one error, before any model loads."""
    if dynamic_sampling or any(not is_conversational(row["prompt"]) for row in rows):
        raise UserError("--tools and --environment_factory need conversational prompts (lists of messages), and no "
                        "--dynamic_sampling (an environment's reset may change a prompt, which it could not rebuild)")
    functions = [import_function(spec, "tool") for spec in function_specs]
    specs = [environment_factory] if isinstance(environment_factory, str) else list(environment_factory or [])
    named = [spec.partition("=")[::2] if "=" in spec else (None, spec) for spec in specs]
    if len(named) > 1 and any(name is None for name, _ in named):
        raise UserError("several --environment_factory need a name each, `name=module:Class` (each row's "
                        f"`environment` field picks one); got {' '.join(specs)}")
    factories = {name: import_function(path, "environment factory") for name, path in named}  # TRL: any callable
    pools = {name: [made(factory, timeout) for _ in range(num_episodes if name is None else 1)] for name, factory in
             factories.items()}  # one environment: an instance per episode slot; several: one each, more as needed
    for (_, path), pool in zip(named, pools.values()):
        if not callable(getattr(type(pool[0]), "reset", None)):
            raise UserError(f"environment factory '{path}' makes environments with no reset(**row) method")
    unknown = {row.get("environment") for row in rows} - set(factories) if None not in factories else set()
    if factories and unknown:
        raise UserError(f"rows name environments {', '.join(map(repr, sorted(map(str, unknown))))} that "
                        f"--environment_factory does not define (it defines {', '.join(map(str, factories))}; 'None': "
                        "no `environment` field, as in a run without a dataset, where one environment gives prompts)")
    schemas = {None: [schema(f, spec) for f, spec in zip(functions, function_specs)]} | {  # each class once
        cls: [schema(getattr(cls, n), f"{cls.__name__}.{n}") for n in environment_methods(cls)]
        for cls in dict.fromkeys(type(env) for pool in pools.values() for env in pool)}  # a factory may vary it
    every = [s for group in schemas.values() for s in group]
    if not every:
        raise UserError(f"environment factory '{specs[0]}' has no public method for the model to call")
    template = tokenizer.chat_template or ""
    if not template or every[0]["function"]["name"] not in tokenizer.apply_chat_template(
            [{"role": "user", "content": "x"}], tools=every, tokenize=False):  # a template that renders tools
        raise UserError(f"the chat template of {getattr(tokenizer, 'described', 'the tokenizer')} renders no tools; "
                        "pass --chat_template_path with one that does (e.g. configs/chatml_tools.jinja)")
    if "<tool_call>" in template:
        call_format = "hermes"
    elif "<|start_header_id|>" in template and "<|eot_id|>" in template:
        call_format = "llama3"
    else:
        family = next((name for marker, name in (("<|im_start|>", "ChatML without <tool_call>"), ("[INST]", "Mistral"),
                                                 ("<start_of_turn>", "Gemma")) if marker in template), "unknown")
        raise UserError(f"tool calls in the chat template's format ({family}) cannot be parsed; use a template that "
                        "writes <tool_call>{...}</tool_call> (ChatML / Qwen / Hermes, e.g. configs/chatml_tools.jinja) "
                        "or Llama 3's bare JSON (--chat_template_path)")
    tool_turn_text(tokenizer, [{"role": "tool", "name": every[0]["function"]["name"], "content": "1"}])  # as a turn
    return Tools(functions, schemas, call_format, factories, pools, timeout=timeout or None)


def parse_tool_calls(text: str, call_format: str) -> tuple[str, list]:
    """(the turn's text before its first call, [{"name", "arguments"} or {"error"} for a call that does not parse])."""
    if call_format == "hermes":
        found = list(HERMES_CALL.finditer(text))
        content, bodies = (text[:found[0].start()].strip() if found else text), [m.group(1) for m in found]
    else:  # Llama 3: the whole turn is one JSON object {"name", "parameters"} when it calls
        content, bodies = (("", [text.strip()]) if text.strip().startswith("{") else (text, []))
    calls = []
    for body in bodies:
        try:
            xml = XML_FUNCTION.match(body)
            call = json.loads(body) if xml is None else {"name": xml[1].strip(), "arguments": {
                k.strip(): _value(v) for k, v in XML_PARAMETER.findall(xml[2])}}
            arguments = call.get("arguments", call.get("parameters", {}))
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
            if not isinstance(call["name"], str) or not isinstance(arguments, dict):
                raise ValueError("name must be a string and arguments an object")
            calls.append({"name": call["name"], "arguments": arguments})
        except (ValueError, KeyError, AttributeError, TypeError) as e:
            calls.append({"error": f"could not parse the tool call {body[:80]} ({type(e).__name__}: {e})"})
    return content, calls


def _value(text: str):
    """An XML-form argument: JSON when it parses as JSON (numbers, objects), else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def call_tool(functions: dict, call: dict, timeout: float | None = None, max_chars: int | None = None):
    """(the tool message answering `call`, whether it failed). With a timeout the tool runs in a thread of its own,
    waited for that long: one that hangs is answered as failed and left behind (a daemon thread: Python cannot stop
    a thread, and the process can still exit). The answer's text is cut to max_chars + 1 characters before anyone
    tokenises it (a longer one cannot fit: run_episodes)."""
    name, failed = call.get("name", "unknown"), False
    try:
        if "error" in call or name not in functions:  # a call that did not parse, or an unknown tool
            raise ValueError(call.get("error") or f"Tool {name} not found.")
        answer = {}
        if timeout is None:
            _answer(functions[name], call["arguments"], answer)
        else:
            worker = threading.Thread(target=_answer, args=(functions[name], call["arguments"], answer), daemon=True,
                                      name=f"tool {name}")
            worker.start()
            worker.join(timeout)
            if worker.is_alive():
                raise TimeoutError(f"tool {name} did not answer within {timeout:g} s (--tool_timeout)")
        if "error" in answer:
            raise answer["error"]
        result = answer["result"]
        text = result if isinstance(result, str) else str(result)
    except Exception as e:  # the model's arguments, or the tool itself
        text, failed = str({"error": str(e)}), True
    return {"role": "tool", "name": name, "content": text[:None if max_chars is None else max_chars + 1]}, failed


def _answer(fn, arguments: dict, answer: dict):
    try:  # an async tool (or environment method) awaited on the run's event loop, as TRL awaits it
        answer["result"] = resolved(fn(**arguments))
    except Exception as e:
        answer["error"] = e


REPLY = "REPLY-7c1e"  # a stand-in assistant reply, found again in the renderings


def tool_turn_text(tokenizer, tool_messages: list) -> str:
    """What the chat template writes after an assistant turn's end for these tool results, up to and including
    the next assistant header. The turn's end is what the template writes after the reply when the turn is the
    conversation's last (without the whitespace after it, as the model stops at its end token); what follows it
    once the tool results come is this text. Only what comes after the reply is compared: a template may render
    an earlier turn's start differently (Qwen3's original writes an empty <think></think> on the last assistant
    turn only), which the episode never re-renders (the model's own tokens stay as sampled)."""
    before = [{"role": "user", "content": "x"}, {"role": "assistant", "content": REPLY}]
    alone = tokenizer.apply_chat_template(before, tokenize=False).rstrip()
    full = tokenizer.apply_chat_template(before + tool_messages, add_generation_prompt=True, tokenize=False)
    end = alone[alone.rfind(REPLY) + len(REPLY):]  # e.g. <|im_end|>, <|eot_id|>
    at = full.rfind(REPLY) + len(REPLY)
    if REPLY not in alone or REPLY not in full or not full.startswith(end, at):
        raise UserError("the chat template ends an assistant turn differently once tool results follow (after the "
                        f"reply: {full[at:at + 30]!r}, alone: {end!r}); its tool turns cannot be appended to the "
                        "model's tokens: pass --chat_template_path (e.g. configs/chatml_tools.jinja)")
    return full[at + len(end):]


@dataclass
class Episodes:
    samples: Samples  # completion_ids: every token after the prompt; model_mask: 1 on the model's own
    completions: list  # per episode its messages: assistant (with tool_calls), tool, ..., assistant
    turns: torch.Tensor  # [N] assistant turns
    calls: torch.Tensor  # [N] tool calls made
    failures: torch.Tensor  # [N] of them failed
    columns: dict  # for reward functions beside the dataset's: environments= (one per episode), as TRL passes them
    prompts: list  # as the episodes began (an environment's reset() string appended): reward functions' (TRL's)

    def batch(self) -> dict:
        """What a script keeps of a multi-turn rollout beside its completions (tensors, gathered alike)."""
        return dict(episode_mask=self.samples.completion_mask, prompt_ids=self.samples.prompt_ids,
                    prompt_mask=self.samples.prompt_mask, turns=self.turns, calls=self.calls, failures=self.failures)


def episode_metrics(accelerator, finished, turns, calls, failures) -> dict:
    """TRL's tool metrics (calls per episode; failed calls per call), the episodes' turns and the share cut by
    max_completion_length, over all processes."""
    finished, turns, calls, failures = (accelerator.gather(t).float() for t in (finished, turns, calls, failures))
    return {"tools/call_frequency": calls.mean().item(),
            "tools/failure_frequency": (failures.sum() / calls.sum().clamp(min=1)).item(),
            "episodes/turns_mean": turns.mean().item(), "episodes/turns_max": turns.max().item(),
            "episodes/truncated_ratio": 1 - finished.mean().item()}


def run_episodes(sample, tokenizer, rows: list[dict], tools: Tools | None, *, prompt_ids: list, seeds: list[int],
                 max_new_tokens: int, max_prompt_length: int, max_calls: int | None, accelerator,
                 **sampling) -> Episodes:
    """Episodes for rows (one per row), turn after turn. sample(prompt_ids, seeds, max_new_tokens, **sampling) ->
    Samples draws one turn of several episodes (HF generate or vLLM); a turn's seed is the episode's seed plus
    the turn's number x 2**48. tools None: one turn from `prompt_ids` (the rows' prompts, encoded), the completion
    as reward functions take it (a string, or one assistant message). Every process samples as many turns as
    the longest episode on any of them, so sharded decoding stays in step (with nothing left, one token is
    drawn and dropped)."""
    if tools is None:
        out = sample(prompt_ids, seeds, max_new_tokens=max_new_tokens, **sampling)
        texts = tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
        prompts, ones = [r["prompt"] for r in rows], torch.ones(len(rows), dtype=torch.long, device=out.finished.device)
        return Episodes(replace(out, model_mask=out.completion_mask), as_completions(prompts, texts), ones, 0 * ones,
                        0 * ones, {}, prompts)
    prompts = [without_nulls(row["prompt"]) for row in rows]  # new lists of new messages: reset's string goes in
    if tools.factories:
        tools.assign(rows)
    for i, (env, row) in enumerate(zip(tools.environments or [], rows)):
        # several environments: the row's `environment` picks one, and reset(**row) does not get it (TRL); reset is
        # held to --tool_timeout as the environment's tools are, but cannot answer an error: past it the run ends
        row = {k: v for k, v in row.items() if k != "environment"} if None not in tools.factories else row
        if extra := called(env.reset.__qualname__, env.reset, row, tools.timeout or 0, what="environment",
                           flag="--tool_timeout"):
            prompts[i][-1]["content"] += extra  # TRL's rule: reset's string goes at the end of the last message
    context = [encode_prompt(tokenizer, p, tools.schemas_for(i))[-max_prompt_length:] for i, p in enumerate(prompts)]
    n = len(rows)
    ids, own, logps = [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)]
    completions, finished = [[] for _ in range(n)], [False] * n
    turns, calls, failures, call_turns = [0] * n, [0] * n, [0] * n, [0] * n
    active, turn = list(range(n)), 0
    while (bool(active) if accelerator is None else  # None: no other process to keep in step (a local sampler)
           accelerator.reduce(torch.tensor(float(bool(active)), device=accelerator.device), "max").item() > 0):
        todo = active or [0]  # with nothing left here: one token, dropped
        budget = max(max_new_tokens - len(ids[i]) for i in active) if active else 1
        out = sample([context[i] + ids[i] for i in todo], [seeds[i] + turn * 2**48 for i in todo],
                     max_new_tokens=budget, **sampling)
        turn, still = turn + 1, []
        for row, i in enumerate(active):
            length = int(out.completion_mask[row].sum())
            new = out.completion_ids[row, :length].tolist()[:max_new_tokens - len(ids[i])]
            ids[i], own[i], turns[i] = ids[i] + new, own[i] + [1] * len(new), turns[i] + 1
            if out.sampler_logps is not None:
                logps[i] += out.sampler_logps[row, :len(new)].tolist()
            content, parsed = parse_tool_calls(tokenizer.decode(new, skip_special_tokens=True), tools.call_format)
            message = {"role": "assistant", "content": content}
            completions[i].append(message | ({"tool_calls": [{"type": "function", "function": c} for c in parsed
                                                             if "error" not in c]} if parsed else {}))
            stopped = bool(out.finished[row]) and len(new) == length
            if not stopped or not parsed or (max_calls is not None and call_turns[i] >= max_calls):
                finished[i] = stopped  # the episode ends: answered, out of tokens, or out of calls
                continue
            # no token is near 64 characters long: a result longer than that per token of room left cannot fit
            # (and is never tokenised whole)
            functions, most = tools.for_episode(i), 64 * (max_new_tokens - len(ids[i]))
            answers = [call_tool(functions, call, tools.timeout, most) for call in parsed]
            calls[i], failures[i] = calls[i] + len(answers), failures[i] + sum(failed for _, failed in answers)
            call_turns[i] += 1
            if any(len(m["content"]) > most for m, _ in answers):  # no room for the results: truncated
                continue
            glue = tokenizer(tool_turn_text(tokenizer, [m for m, _ in answers]), add_special_tokens=False).input_ids
            if len(ids[i]) + len(glue) >= max_new_tokens:  # no room for the results and a reply: truncated
                continue
            ids[i], own[i], logps[i] = ids[i] + glue, own[i] + [0] * len(glue), logps[i] + [0.0] * len(glue)
            completions[i] += [m for m, _ in answers]
            still.append(i)
        active = still
    prompt_ids, prompt_mask = pad(context, tokenizer.pad_token_id, side="left")
    completion_ids = torch.tensor([x + [tokenizer.pad_token_id] * (max_new_tokens - len(x)) for x in ids])
    completion_mask = torch.tensor([[1] * len(x) + [0] * (max_new_tokens - len(x)) for x in ids])
    device = out.completion_ids.device
    samples = Samples(prompt_ids.to(device), prompt_mask.to(device), completion_ids.to(device),
                      completion_mask.to(device), torch.tensor(finished, device=device),
                      sampler_logps=torch.tensor([x + [0.0] * (max_new_tokens - len(x)) for x in logps],
                                                 device=device) if out.sampler_logps is not None else None,
                      model_mask=torch.tensor([x + [0] * (max_new_tokens - len(x)) for x in own], device=device))
    return Episodes(samples, completions, *(torch.tensor(x, device=device) for x in (turns, calls, failures)),
                    {"environments": tools.environments} if tools.environments else {}, prompts)

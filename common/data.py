"""Datasets in TRL's formats: loading, validation, chat templates, prompt/completion tokens. Each format
is *standard* (strings) or *conversational* (lists of {"role", "content"} messages, chat template):
  prompt-completion  prompt, completion              (SFT; e.g. trl-lib/tldr)
  messages           messages                        (SFT; every assistant turn is learnt)
  language modelling text                            (SFT; every token is learnt)
  preference         prompt, chosen, rejected        (reward, DPO, KTO; e.g. trl-lib/tldr-preference)
  implicit prompt    chosen, rejected                (the shared start is the prompt; `split_implicit_prompt`)
  unpaired           prompt, completion, label       (KTO)
  prompt-only        prompt                          (online RL)
"""

import os
import random
import re

from datasets import Dataset, DatasetDict, load_dataset, load_from_disk

from common.runtime import UserError, check_built

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def load_split(name: str, split: str) -> Dataset:
    """A split of a hub dataset, a local dataset folder (`save_to_disk`, or data files named by split)
    or one .json/.jsonl/.parquet/.csv file (split "train")."""
    check_built(name, "dataset")
    builder = FILE_BUILDERS.get(os.path.splitext(name)[1])
    if os.path.isfile(name) and builder is None:
        raise UserError(f"dataset file '{name}' is not one of {sorted(FILE_BUILDERS)}")
    try:
        if os.path.isfile(name):
            splits = load_dataset(builder, data_files={"train": name})
        elif any(os.path.exists(os.path.join(name, f)) for f in ("dataset_dict.json", "dataset_info.json")):
            splits = load_from_disk(name)
        else:
            splits = load_dataset(name)
    except Exception as e:  # the hub, the file system and the parsers all raise their own types
        first_line = (str(e).splitlines() or [""])[0]
        # how `datasets` reports empty data files: "... corresponds to no data", or (all json) StopIteration
        if "corresponds to no data" in first_line or isinstance(e, StopIteration):
            raise UserError(f"dataset '{name}' has an empty split ({first_line or 'its data files hold no rows'}); "
                            "add rows, or choose another split with the *_split flags") from None
        raise UserError(f"could not load dataset '{name}' ({type(e).__name__}: {first_line}); pass a hub dataset "
                        "name, a local dataset directory, or a .json/.jsonl/.parquet/.csv file") from None
    if isinstance(splits, Dataset):
        splits = DatasetDict({"train": splits})
    if split not in splits:
        raise UserError(f"dataset '{name}' has no split '{split}' (it has: {', '.join(splits)}); "
                        "choose one with the *_split flags")
    if len(splits[split]) == 0:
        raise UserError(f"split '{split}' of dataset '{name}' is empty; add rows, or choose another split "
                        "with the *_split flags")
    return splits[split]


def check_columns(dataset: Dataset, formats: dict[str, list[str]], where: str) -> str:
    """The first format whose columns the dataset has (their text checked); else one error listing all."""
    for fmt, columns in formats.items():
        if all(c in dataset.column_names for c in columns):
            check_text_fields(dataset, [c for c in columns if c != "label"], where)
            return fmt
    missing = {fmt: ", ".join(c for c in cols if c not in dataset.column_names) for fmt, cols in formats.items()}
    accepted = "; ".join(f"{fmt} ({', '.join(cols)}: missing {missing[fmt]})" for fmt, cols in formats.items())
    raise UserError(f"{where} has columns [{', '.join(dataset.column_names)}], which fit no accepted "
                    f"format: {accepted}")


def check_prompts_fill_a_batch(num_prompts: int, batch_prompts: int, how: str):
    """The online scripts draw whole batches of distinct prompts: fewer than a batch would never fill one."""
    if num_prompts < batch_prompts:
        raise UserError(f"{num_prompts} prompts make no full batch of {batch_prompts} prompts ({how}); add prompts, "
                        "or lower those flags")


def load_prompts(tokenizer, name: str, split: str, script: str, max_tokens: int, batch_prompts: int, how: str):
    """The rows of a split with a prompt column and each prompt's token ids (its last max_tokens), refused when they
    fill no batch of batch_prompts distinct prompts (`how`: the flags that size it). No dataset (name "", with one
    environment: check_flags): a batch of rows of one empty user message, which reset() fills (TRL's)."""
    if name:
        dataset = load_split(name, split)
        check_columns(dataset, {"prompt-only": ["prompt"]}, f"dataset '{name}' (split {split}), given to {script},")
        rows = list(dataset)
        check_prompts_fill_a_batch(len(rows), batch_prompts, how)
    else:
        rows = [{"prompt": [{"role": "user", "content": ""}]} for _ in range(batch_prompts)]
    return rows, [encode_prompt(tokenizer, row["prompt"])[-max_tokens:] for row in rows]


def is_conversational(value) -> bool:
    return isinstance(value, list) and len(value) > 0 and isinstance(value[0], dict)


def as_completions(prompts: list, texts: list[str]) -> list:
    """Completions as reward functions take them (TRL): one assistant message after a conversational prompt, else
    the text."""
    return [[{"role": "assistant", "content": t}] if is_conversational(p) else t for p, t in zip(prompts, texts)]


def _is_messages(value) -> bool:
    """{"role", "content"} dicts; an assistant message may hold `tool_calls` in place of content (TRL's tool use)."""
    return is_conversational(value) and all(isinstance(m, dict) and isinstance(m.get("role"), str) and (
        isinstance(m.get("content"), str) or m["role"] == "assistant" and bool(m.get("tool_calls"))) for m in value)


def without_nulls(value):
    """A row's messages or tool schemas as written: Arrow stores dicts of different keys under the union of their
    keys, and gives each the others' as None (a tool call's content, another tool's parameters)."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    return [without_nulls(v) for v in value] if isinstance(value, list) else value


def check_text_fields(dataset: Dataset, columns: list[str], where: str):
    """Every value a string, or every one a list of {"role", "content"} messages (`messages` always); else
    one error naming the column, row and type (a null fails deep in the tokenizer, a list of strings is
    silently tokenized as a batch)."""
    kinds = {}
    for column in columns:
        # through Arrow (iterating dataset[column] is ~25x slower); messages of mixed keys: Json, stored as text
        values = dataset.features.decode_column(dataset.with_format("arrow")[column].to_pylist(), column)
        for i, value in enumerate(values):
            kind = "messages" if _is_messages(value) else "string" if isinstance(value, str) else None
            if kind is None or (column == "messages" and kind != "messages"):
                got = "null" if value is None else f"{type(value).__name__} {str(value)[:40]!r}"
                raise UserError(f"{where} has {got} in column '{column}' at row {i}; each {column} must be "
                                + ("" if column == "messages" else "a string or ")
                                + 'a non-empty list of {"role": str, "content": str} messages; fix or drop that row')
            kinds.setdefault(kind, column)
    if len(kinds) > 1:
        raise UserError(f"{where} mixes strings (column '{kinds['string']}') with lists of messages (column "
                        f"'{kinds['messages']}'); make every text column strings, or every one messages")


def prompt_text(tokenizer, prompt, tools: list | None = None) -> str:
    """A string as is, or messages through the chat template (with the tools' schemas), ready for the assistant's
    turn."""
    if not is_conversational(prompt):
        return prompt
    if not tokenizer.chat_template:
        raise UserError(f"the dataset is conversational (lists of messages) but "
                        f"{getattr(tokenizer, 'described', 'the tokenizer')} has no chat template; use a tokenizer "
                        "with one, or standard (string) data")
    return tokenizer.apply_chat_template(without_nulls(prompt), tools=tools, add_generation_prompt=True,
                                         tokenize=False)


def completion_text(tokenizer, prompt, completion) -> str:
    """The completion as text; for messages (after messages: `check_text_fields` refuses a mix), what the chat
    template adds after the prompt."""
    if not is_conversational(completion):
        return completion
    before = prompt_text(tokenizer, prompt)  # checks the chat template
    full = tokenizer.apply_chat_template(list(prompt) + list(completion), tokenize=False)
    if not full.startswith(before):
        raise UserError(f"the chat template of {getattr(tokenizer, 'described', 'the tokenizer')} renders the prompt "
                        "differently with and without the completion; its completion tokens cannot be separated")
    return full[len(before):].rstrip()  # the template's trailing newline would follow the EOS


NO_SHARED_START = "without a prompt column, chosen and rejected share no start to be the prompt"


def split_implicit_prompt(chosen, rejected):
    """(prompt, chosen, rejected) of a preference row without a prompt column: the start both share.
    Messages (trl-lib/ultrafeedback_binarized): the leading messages both have, one left to each at least.
    Strings (Anthropic/hh-rlhf): the shared text cut back to a whitespace, so each completion starts at a
    word (words both open with stay in the prompt). Empty when nothing is shared."""
    if is_conversational(chosen):
        n = 0
        while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
            n += 1
        return chosen[:n], chosen[n:], rejected[n:]
    shared = os.path.commonprefix([chosen, rejected])
    # back to the start of the word where they part (or where the shorter one ends), and over the whitespace before
    # it: the completion keeps its leading space, as in "Assistant: Sure"
    n = len(re.sub(r"\s*\S*\Z", "", shared))
    return chosen[:n], chosen[n:], rejected[n:]


def encode_prompt(tokenizer, prompt, tools: list | None = None) -> list[int]:
    """Prompt ids; special tokens (BOS) added for plain text only: a chat template writes its own."""
    text = prompt_text(tokenizer, prompt, tools)
    return tokenizer(text, add_special_tokens=not is_conversational(prompt)).input_ids


def encode_completion(tokenizer, prompt, completion) -> list[int]:
    """Completion ids ending in exactly one EOS, and no BOS (which Llama-style tokenizers would add)."""
    ids = tokenizer(completion_text(tokenizer, prompt, completion), add_special_tokens=False).input_ids
    return ids if ids and ids[-1] == tokenizer.eos_token_id else ids + [tokenizer.eos_token_id]


def prompt_batches(num_rows: int, num_prompts: int, repeat: int, *, seed: int, rank: int, local_size: int,
                   skip: int = 0):
    """Endless: a global batch of num_prompts row indices, each `repeat` times in a row (a group, which may span
    processes), then this process's share of local_size; a new shuffle, the same on every process, per pass.
    The first `skip` batches are passed over (a resumed run's data position)."""
    rng, batch = random.Random(seed), 0
    while True:
        order = list(range(num_rows))
        rng.shuffle(order)
        for start in range(0, num_rows - num_prompts + 1, num_prompts):
            repeated = [i for i in order[start:start + num_prompts] for _ in range(repeat)]
            batch += 1
            if batch > skip:
                yield repeated[rank * local_size:(rank + 1) * local_size]

"""Padding-free passes (--padding_free, TRL's name; issue 57): the real tokens of a micro-batch's rows go into
packed sequences whose position ids restart at each row, so that no compute goes to padding. transformers (5.x:
`masking_utils.find_packed_sequence_indices`) builds the block-diagonal causal mask from position ids that restart
when the model is given no attention mask and no cache (SDPA, eager, and flash-attention's variable-length kernels),
so no row attends to another. SDPA and eager get packed rows no longer than the longest row where that costs less
than one packed row (bin_length); flash-attention gets one. The completion passes (grpo, rloo, online_dpo, ppo, gkd)
may also hold each prompt once with its completions after it, under a 4D mask of ours (SDPA and eager: a dense mask
costs the square of a packed row), as the padded pass runs a prompt once for its samples; each pass takes the layout
with the fewest multiply-adds by a rough count. The per-token values come back in the padded layout the losses read;
in the completion passes only the positions that predict a completion token go through the LM head."""

import weakref
from dataclasses import dataclass

import torch
import tyro

from common.generation import token_entropy_no_grad, token_logprobs
from common.runtime import UserError


@tyro.conf.configure(tyro.conf.OmitArgPrefixes)  # --padding_free, not --packing.padding-free
@dataclass
class PackingArgs:
    """padding-free training (common/packing.py)"""
    padding_free: bool = False
    """each micro-batch's rows packed into sequences, position ids restarting per row: no compute on padding (TRL's
    name)"""


def _first_fit(lengths: list[int], width: int, longest_first: bool):
    """Each row's start in the packed tokens flattened, and each packed row's fill: rows go first-fit into packed
    rows of `width` positions (longest first, or in order)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i]) if longest_first else range(len(lengths))
    starts, fill = [0] * len(lengths), []
    for i in order:
        k = next((k for k, used in enumerate(fill) if used + lengths[i] <= width), len(fill))
        fill += [0] * (k == len(fill))
        starts[i], fill[k] = k * width + fill[k], fill[k] + lengths[i]
    return starts, fill


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, bin_length: int | None = None):
    """[B, T] rows (padded on either side) -> their real tokens packed, [K, L], position ids [K, L] restarting at 0
    with each row, and each real token's place in the packed tokens flattened, [B, T] (-1 on padding).
    bin_length None: one packed row, the rows in order. Else the rows go first-fit, longest first, into K packed rows
    of bin_length positions; the room left at a packed row's end is a row of its own (token 0, positions restarting)
    that no loss reads."""
    real, lengths = attention_mask.bool(), attention_mask.sum(-1).tolist()
    width = bin_length or sum(lengths)
    starts, fill = _first_fit(lengths, width, longest_first=bin_length is not None)
    offsets = attention_mask.cumsum(-1) - 1
    place = torch.where(real, torch.tensor(starts, device=real.device)[:, None] + offsets, -1)
    ids = input_ids.new_zeros(len(fill) * width)
    ids[place[real]] = input_ids[real]
    room = torch.arange(width, device=real.device) - torch.tensor(fill, device=real.device)[:, None]
    positions = room.clamp(min=0).flatten()  # the room at a packed row's end: positions from 0
    positions[place[real]] = offsets[real]
    return ids.view(len(fill), width), positions.view(len(fill), width), place


def _macs(model):
    """A rough count of multiply-adds, (per position, per pair of positions in one packed row), from the config; None
    for a kernel that packs by itself (flash-attention's variable-length one: transformers reads restarting positions
    as separate rows there only in a batch of one) or a config without the names read. A position costs the layers'
    projections and the LM head, layers x (4 h^2 + 3 h f) + V h; SDPA and eager attention get a dense mask over a
    packed row, so a pair of its positions costs 2 h x layers whether or not they attend."""
    config = getattr(getattr(model, "module", model), "config", None)
    try:
        h, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    except AttributeError:
        return None
    f = getattr(config, "intermediate_size", None) or 4 * h
    return layers * (4 * h * h + 3 * h * f) + vocab * h, 2 * h * layers


def _dense(model) -> bool:
    """SDPA or eager attention: a packed row gets a dense mask (no variable-length kernel)."""
    config = getattr(getattr(model, "module", model), "config", None)
    return getattr(config, "_attn_implementation", None) in ("sdpa", "eager")


def _cost(macs, lengths: list[int], width: int) -> int:
    """The multiply-adds of segments of these lengths packed first-fit, longest first, into rows of `width`."""
    return len(_first_fit(lengths, width, longest_first=True)[1]) * width * (macs[0] + width * macs[1])


def bin_length(model, attention_mask: torch.Tensor) -> int | None:
    """Packed rows no longer than the longest row (bins), or one packed row (None), whichever costs fewer multiply-adds
    by _macs' count: one row's attention costs its length squared, bins cost the room at their ends. Kernels that pack
    by themselves get one row; a config without the names read gets bins, which never cost more than padded."""
    lengths, macs = attention_mask.sum(-1).tolist(), _macs(model)
    if not _dense(model):
        return None
    return max(lengths) if macs is None or _cost(macs, lengths, max(lengths)) < _cost(macs, lengths, sum(lengths)) \
        else None


_CHECKED = weakref.WeakSet()  # the models whose packing has been checked
_SHARED_MASK = weakref.WeakKeyDictionary()  # model -> whether it keeps to a 4D attention mask of ours


def _hidden(model, ids, positions, mask=None):
    return model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=False,
                 output_hidden_states=True).hidden_states[-1][0].float()


@torch.no_grad()
def check_packing(model):
    """Refuses, in one line, a model whose packed rows are not independent (recurrent or state-space layers, an
    attention that ignores restarting position ids): two short rows packed must give the second row's last hidden
    states as that row gives alone. Then notes whether the model keeps to a 4D attention mask (the completion passes'
    shared prompts): one prompt with two completions after it must give the second completion's as prompt and
    completion alone. Once per model, at its first packed pass (so on every rank at the same point: a forward is a
    collective under ZeRO-3 and FSDP2), in eval mode (no dropout)."""
    model = getattr(model, "module", model)  # DDP / DeepSpeed's wrapper: the model's own forward
    if model in _CHECKED:
        return
    device = next(model.parameters()).device
    first, second = torch.arange(3, 8, device=device)[None], torch.arange(11, 15, device=device)[None]
    rows = torch.tensor([[3, 4, 5, 6, 7, 11, 12, 13, 14], [3, 4, 5, 6, 7, 20, 21, 22, 0]], device=device)
    # bf16 / fp16 weights round; so do a GPU's kernels (TF32, autocast, a masked attention kernel against a causal one)
    tolerance = 1e-4 if next(model.parameters()).dtype == torch.float32 and device.type == "cpu" else 3e-2
    training, _ = model.training, model.eval()
    try:
        packed = _hidden(model, torch.cat([first, second], 1), torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3]],
                         device=device))[5:]
        alone = _hidden(model, second, None)
        scale = alone.abs().max().clamp(min=1e-6)
        if not (packed - alone).abs().max() <= tolerance * scale:
            raise UserError(f"--padding_free: {type(model).__name__} lets packed rows see each other (a row's hidden "
                            f"states change by {float((packed - alone).abs().max() / scale):.1%} when another row is "
                            "packed before it: recurrent or state-space layers, or an attention that ignores "
                            "restarting position ids); train it padded, without --padding_free")
        if _dense(model):
            ids, positions, sees, _ = _shared_prompts(rows, (rows > 0).long(), 5, 12)
            shared = _hidden(model, ids, positions, _attention_mask(model, sees))[9:]
            alone = _hidden(model, rows[1:, :8], None)[5:]
            _SHARED_MASK[model] = bool((shared - alone).abs().max() <= tolerance * alone.abs().max())
    finally:
        model.train(training)
    _CHECKED.add(model)


def packed_forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor):
    """A micro-batch's causal-LM forward packed (in packed rows of bin_length), flattened to one row: (logits
    [1, N, V], input_ids [1, N], loss_mask [1, N], each packed token's row [N]; a packed row's room: mask 0, row 0)
    for a loss that reads logits[:, :-1] against input_ids[:, 1:] under loss_mask[:, 1:], each row's first token out
    of it (no token of its own row predicts it; nor the last token of the packed row before). No cache: with one,
    transformers does not read the restarting position ids as separate rows, and every row would attend to the rows
    before it."""
    check_packing(model)
    ids, positions, place = pack(input_ids, attention_mask, bin_length(model, attention_mask))
    logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits.flatten(0, 1)[None]
    real, flat = attention_mask.bool(), place[attention_mask.bool()]
    mask, rows = loss_mask.new_zeros(ids.numel()), torch.zeros(ids.numel(), dtype=torch.long, device=ids.device)
    mask[flat] = loss_mask[real]
    rows[flat] = torch.arange(len(input_ids), device=ids.device)[:, None].expand_as(real)[real]
    return logits, ids.view(1, -1), mask[None] * (positions.view(1, -1) > 0), rows


def packed_sequence_logps(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                          completion_mask: torch.Tensor):
    """Per row from one packed forward: the summed log-probabilities of its completion tokens, their count, and the
    mean logit over them (as dpo.py's and kto.py's padded passes give them)."""
    logits, ids, mask, rows = packed_forward(model, input_ids, attention_mask, completion_mask)
    mask, rows, n = mask[0, 1:], rows[1:], len(input_ids)
    logps = token_logprobs(logits[:, :-1], ids[:, 1:])[0] * mask
    counts = torch.zeros(n, dtype=mask.dtype, device=mask.device).index_add(0, rows, mask)
    mean_logits = logits[0, :-1].detach().float().mean(-1) * mask
    return (logps.new_zeros(n).index_add(0, rows, logps), counts,
            mean_logits.new_zeros(n).index_add(0, rows, mean_logits) / counts)


def _prompt_groups(input_ids, attention_mask, prompt_width: int):
    """Rows that share a prompt (a prompt's samples): each row's group [B], each group's first row [G], and each
    group's segment length, its prompt once and all its completions [G]."""
    _, group = torch.unique(torch.cat([input_ids[:, :prompt_width], attention_mask[:, :prompt_width]], 1), dim=0,
                            return_inverse=True)
    rows = torch.arange(len(group), device=group.device)
    first = group.new_zeros(int(group.max()) + 1).scatter_(0, group.flip(0), rows.flip(0))
    lengths = attention_mask[first, :prompt_width].sum(-1).index_add(0, group, attention_mask[:, prompt_width:].sum(-1))
    return group, first, lengths


def _shared_prompts(input_ids, attention_mask, prompt_width: int, width: int | None):
    """Each prompt once, its completions after it (padded, shared_prefix_cache runs it once too): one segment per
    prompt, segments first-fit, longest first, into packed rows of `width` (None: one row). Returns the packed ids
    and position ids [K, L] (a completion's continue from its prompt's), who attends to whom [K, L, L] (a
    completion's token: its prompt and the tokens of its own completion before it; the room at a row's end: itself),
    and the flattened packed position that predicts each completion token [B, T - prompt_width] (a completion's
    first: its prompt's last)."""
    group, first, lengths = _prompt_groups(input_ids, attention_mask, prompt_width)
    device, n, rows = input_ids.device, len(first), torch.arange(len(input_ids), device=input_ids.device)
    width = width or int(lengths.sum())
    starts, fill = _first_fit(lengths.tolist(), width, longest_first=True)
    starts, size = torch.tensor(starts, device=device), len(fill) * width
    ids = input_ids.new_zeros(size)
    room = torch.arange(width, device=device) - torch.tensor(fill, device=device)[:, None]
    positions = room.clamp(min=0).flatten()
    segment = n + torch.arange(size, device=device) // width  # the room: a segment of its own per packed row
    branch = torch.full_like(segment, -1)  # a completion token's row; -1: a prompt's token (or the room)
    prompt_mask, completion_mask = attention_mask[first, :prompt_width], attention_mask[:, prompt_width:]
    real, offsets = prompt_mask.bool(), prompt_mask.cumsum(-1) - 1
    place = (starts[:, None] + offsets)[real]
    ids[place], positions[place] = input_ids[first, :prompt_width][real], offsets[real]
    segment[place] = torch.arange(n, device=device)[:, None].expand_as(real)[real]
    p, c = prompt_mask.sum(-1)[group], completion_mask.sum(-1)  # per row
    before_mine = torch.nn.functional.one_hot(group, n) * c[:, None]  # completions of the group's earlier rows
    start = starts[group] + p + (before_mine.cumsum(0) - before_mine)[rows, group]
    real, offsets = completion_mask.bool(), completion_mask.cumsum(-1) - 1
    place = start[:, None] + offsets
    ids[place[real]], positions[place[real]] = input_ids[:, prompt_width:][real], (p[:, None] + offsets)[real]
    segment[place[real]] = group[:, None].expand_as(real)[real]
    branch[place[real]] = rows[:, None].expand_as(real)[real]
    before = torch.where(offsets == 0, (starts[group] + p - 1)[:, None], place - 1)
    segment, branch = segment.view(-1, width), branch.view(-1, width)
    sees = (segment[:, :, None] == segment[:, None, :]) & ((branch[:, None, :] == -1) |
                                                         (branch[:, None, :] == branch[:, :, None]))
    sees &= torch.ones(width, width, dtype=torch.bool, device=device).tril()
    return ids.view(-1, width), positions.view(-1, width), sees, torch.where(real, before, -1)


def _choose(model, input_ids, attention_mask, prompt_width: int) -> tuple[str, int | None]:
    """A completion pass's layout for this model, ("rows" or "shared", packed row length or None for one row): SDPA
    and eager take each row with its prompt ("rows") or each prompt once with its completions ("shared", where the
    model keeps to a mask of ours and within its sliding window, which that mask would not apply), in bins or one
    row, whichever _macs counts cheapest; other kernels take each row with its prompt, in one row."""
    inner, macs = getattr(model, "module", model), _macs(model)
    if not _dense(model) or macs is None:
        return "rows", None if not _dense(model) else max(attention_mask.sum(-1).tolist())
    rows = attention_mask.sum(-1).tolist()
    shared = _prompt_groups(input_ids, attention_mask, prompt_width)[2].tolist()
    window = (getattr(inner.config, "sliding_window", None) or sum(shared)) if _SHARED_MASK.get(inner) else 0
    options = [(_cost(macs, rows, w), "rows", w) for w in (max(rows), sum(rows))]
    options += [(_cost(macs, shared, w), "shared", w) for w in (max(shared), sum(shared)) if w <= window]
    _, kind, width = min(options, key=lambda option: option[0])
    return kind, None if width == sum(rows if kind == "rows" else shared) else width


def _layout(model, input_ids, attention_mask, prompt_width: int):
    """A completion pass's packed rows in _choose's layout: (ids [K, L], position ids [K, L], a 4D attention mask or
    None (then position ids restarting per row keep rows apart), the flattened packed position that predicts each
    completion token that is there [M], where those tokens sit in input_ids[:, prompt_width:] [B, T])."""
    targets = attention_mask[:, prompt_width:].bool()
    kind, width = _choose(model, input_ids, attention_mask, prompt_width)
    if kind == "rows":
        ids, positions, place = pack(input_ids, attention_mask, width)
        return ids, positions, None, place[:, prompt_width - 1:-1][targets], targets
    ids, positions, sees, before = _shared_prompts(input_ids, attention_mask, prompt_width, width)
    return ids, positions, _attention_mask(model, sees), before[targets], targets


def _attention_mask(model, sees: torch.Tensor) -> torch.Tensor:
    """Who attends to whom [K, L, L] as a 4D mask that transformers passes on as it is: SDPA's booleans, or eager's
    numbers to add to the scores (0, or the dtype's lowest)."""
    inner = getattr(model, "module", model)
    if inner.config._attn_implementation == "sdpa":
        return sees[:, None]
    dtype = next(inner.parameters()).dtype
    return torch.zeros(sees.shape, dtype=dtype, device=sees.device).masked_fill_(~sees, torch.finfo(dtype).min)[:, None]


def _unpack(values: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[M, ...] values of the completion tokens that are there -> the padded layout [B, T, ...], 0 on padding."""
    out = values.new_zeros(*targets.shape, *values.shape[1:])
    out[targets] = values
    return out


def _completion_logits(policy, input_ids, attention_mask, prompt_width: int):
    """From one packed forward: the logits before each completion token that is there, [1, M, V] (only those
    positions go through the LM head: a hook on it, inside the model's own forward, keeps them), those tokens [1, M],
    and where they sit in input_ids[:, prompt_width:]."""
    check_packing(policy)
    ids, positions, mask, before, targets = _layout(policy, input_ids, attention_mask, prompt_width)
    head = getattr(policy, "module", policy).get_output_embeddings()
    hook = head.register_forward_pre_hook(lambda module, args: (args[0].flatten(0, 1)[before][None], *args[1:]))
    try:
        logits = policy(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=False).logits
    finally:
        hook.remove()
    return logits, input_ids[:, prompt_width:][targets][None], targets


def packed_completion_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """gkd.py's completion_logits from one packed forward: (logits before each completion token [1, M, V], those
    tokens [1, M], a mask of ones [1, M]), the M completion tokens of every row in a row."""
    logits, labels, _ = _completion_logits(model, torch.cat([prompt_ids, completion_ids], 1),
                                           torch.cat([prompt_mask, completion_mask], 1), prompt_ids.shape[1])
    return logits, labels, torch.ones(labels.shape, device=labels.device)


def packed_completion_logps(policy, input_ids, attention_mask, prompt_width: int, temperature: float,
                            entropy: bool = False, **truncation):
    """common.generation.completion_logps from one packed forward: the log-probability of each completion token
    input_ids[:, prompt_width:] (prompts left-padded, completions after them) under logits / temperature, truncated
    as sampling was; [B, T - prompt_width], 0 on padding (the padded pass gives padding a value the losses mask out).
    entropy=True: also each position's entropy (no gradient)."""
    logits, labels, targets = _completion_logits(policy, input_ids, attention_mask, prompt_width)
    logps = _unpack(token_logprobs(logits, labels, temperature, **truncation)[0], targets)
    return (logps, _unpack(token_entropy_no_grad(logits, temperature)[0], targets)) if entropy else logps


def packed_logits_and_values(policy, value_model, input_ids, attention_mask, prompt_width: int):
    """ppo.py's PolicyAndValue pass, each model on one packed row: the policy's logits before each response token
    (input_ids[:, prompt_width:]) and the value model's V(s_t) there (its backbone, then its `score` head), in the
    padded layout [B, T, V] and [B, T], 0 on padding."""
    logits, _, targets = _completion_logits(policy, input_ids, attention_mask, prompt_width)
    check_packing(value_model)
    ids, positions, mask, before, _ = _layout(value_model, input_ids, attention_mask, prompt_width)
    backbone = getattr(value_model, value_model.base_model_prefix)
    hidden = backbone(input_ids=ids, position_ids=positions, attention_mask=mask,
                      use_cache=False).last_hidden_state.flatten(0, 1)[before]
    return _unpack(logits[0], targets), _unpack(value_model.score(hidden).squeeze(-1).float(), targets)


def packed_scores(model, input_ids, attention_mask, prefix: int = 0) -> torch.Tensor:
    """common.rewards.last_token_scores from one packed forward: a one-output classifier's score of each row at its
    last real token, [B]. HF's classifiers pool one position per sequence, so the head's output at every packed
    position is read by a hook on the head (`score`, HF's name for it) inside the model's own forward, which DDP,
    ZeRO-3 and FSDP2 then see as an ordinary call. `prefix` is not used (no shared-prompt cache when packed)."""
    check_packing(model)
    head = getattr(getattr(model, "module", model), "score", None)
    if head is None:
        raise UserError(f"--padding_free reads a reward model's scores from its head `score`; "
                        f"{type(getattr(model, 'module', model)).__name__} has none; train it without --padding_free")
    ids, positions, place = pack(input_ids, attention_mask, bin_length(model, attention_mask))
    outputs = []
    hook = head.register_forward_hook(lambda module, inputs, output: outputs.append(output))
    try:
        model(input_ids=ids, position_ids=positions, use_cache=False)
    finally:
        hook.remove()
    return outputs[0].flatten(0, 1)[place.max(-1).values, 0].float()  # each row's last real token

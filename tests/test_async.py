"""Asynchronous rollouts (--max_staleness K, common/rollouts.py): which weights draw each generation batch, the
staleness weight of the loss worked out here from those weights, the drop rule, the refusals; at K = 1 with tools,
a temperature and truncation (grpo and rloo, one run each shared by two tests): the behaviour policy's log-probs
and each step's gradient against the loss written out with the capped staleness weight; 2 processes equal 1
(multiproc marker; resume: tests/test_common_checkpoint.py)."""

import json
import math
import os
import subprocess
import sys

from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator

from common.episodes import EpisodeArgs
from common.models import ModelArgs
from common.rollouts import RolloutArgs, RolloutStream, check_features
from common.runtime import UserError, flags
from tests.conftest import ROOT, run_script, sampling_logprobs, script_args
from tests.test_multiprocess import TWO_PROCESSES
from tests.test_sft import read_log


def snapshot(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("k", [0, 1])
def test_update_t_learns_from_a_batch_drawn_by_the_weights_of_version_t_minus_k(k, tmp_path, tiny_model, monkeypatch,
                                                                               one_torch_thread):
    """grpo.py with a recording sampler: generation batch t (the one update t learns from) is drawn by exactly
    the weights the trainer published at version t - K (version 0 while the pipeline fills), with the seeds of
    K = 0; at K = 1, each token of update 1's loss weighs min(pi_1 / pi_0, cap) of its own token, both read here
    by one plain forward of the recorded weights (pi_0: the behaviour policy, pi_1: the policy now)."""
    from algos import grpo
    from common import rollouts
    from common.models import load_policy, load_tokenizer
    from common.tracking import Tracker
    from tests.first_step import own_logprobs, write_splits

    published, drawn, losses = {}, [], []
    publish, generate, loss = rollouts.RolloutStream.publish, grpo.generate, grpo.grpo_loss

    def recording_publish(self, model, version):
        published[version] = snapshot(self.accelerator.unwrap_model(model))
        return publish(self, model, version)

    def recording_generate(model, tokenizer, prompts, max_new_tokens, seeds, **options):
        out = generate(model, tokenizer, prompts, max_new_tokens, seeds=seeds, **options)
        drawn.append(dict(weights=snapshot(model), seeds=seeds, out=out, model=model))
        return out

    trained, tracker_step = [], Tracker.step  # K = 0 (the base path, no stream): the weights after each update

    def recording_step(self, n=1):
        trained.append(snapshot(drawn[0]["model"]))
        return tracker_step(self, n)

    def recording_loss(logps, old_logps, ref_logps, advantages, mask, token_weights=1.0, **options):
        losses.append(dict(old=old_logps.detach().clone(), weights=token_weights, mask=mask.clone()))
        return loss(logps, old_logps, ref_logps, advantages, mask, token_weights=token_weights, **options)

    monkeypatch.setattr(rollouts.RolloutStream, "publish", recording_publish)
    monkeypatch.setattr(grpo, "generate", recording_generate)
    monkeypatch.setattr(grpo, "grpo_loss", recording_loss)
    monkeypatch.setattr(Tracker, "step", recording_step)
    rows = [{"prompt": f"SUBREDDIT: r/test POST: day {i} went {'well' if i % 2 else 'badly'}. TL;DR:"}
            for i in range(8)]
    cap, steps = 1.05, 3
    args = script_args(grpo.Args, model_name_or_path=tiny_model, dataset_name=write_splits(tmp_path / "data", rows),
                       reward_model_paths=[], reward_funcs=["tests.toy_rewards:short"], beta=0.0, max_steps=steps,
                       per_device_train_batch_size=8, num_generations=4, max_completion_length=6, learning_rate=1e-2,
                       max_staleness=k, async_importance_sampling_cap=cap, output_dir=str(tmp_path / "out"))
    grpo.main(args)

    if k == 0:  # the weights of version t: those the trainer had after t updates (the first draw: the initial)
        published = {t: trained[t - 1] if t else drawn[0]["weights"] for t in range(steps)}
    assert sorted(published) == list(range(steps)) and len(drawn) >= steps and len(losses) == steps
    for t in range(steps):
        assert same(drawn[t]["weights"], published[max(t - k, 0)]), f"batch {t} not drawn by version {t - k}"
        assert drawn[t]["seeds"] == [args.seed * 10**9 + 8 * t + j for j in range(8)]  # K = 0's data order
    assert not same(published[0], published[1])  # the updates moved the weights: the check above can fail
    if k == 0:
        return
    tokenizer = load_tokenizer(tiny_model)
    policy = load_policy(tiny_model, tokenizer, "float32")

    def logps_under(weights, out):
        policy.load_state_dict(weights, strict=False)
        with torch.no_grad():
            return [own_logprobs(policy, out.prompt_ids[i][out.prompt_mask[i].bool()].tolist(),
                                 out.completion_ids[i][:int(out.completion_mask[i].sum())].tolist())
                    for i in range(len(out.completion_ids))]

    out, record = drawn[1]["out"], losses[1]
    behaviour, now = logps_under(published[0], out), logps_under(published[1], out)
    ratios = torch.cat([torch.exp(a - b) for a, b in zip(now, behaviour)])
    assert (ratios > cap).any() and (ratios < cap).any()  # the cap binds on some tokens, not on others
    for i, (a, b) in enumerate(zip(now, behaviour)):
        n = len(a)
        assert torch.allclose(record["old"][i, :n], a, atol=1e-5)  # pi_old: the policy now, not the behaviour
        assert torch.allclose(record["weights"][i, :n], torch.clamp(torch.exp(a - b), max=cap), atol=1e-4)


class StandInServer:
    """A vLLM server stand-in: completions are their seeds; records the pushes."""
    push_seconds = 0.0

    def __init__(self):
        self.pushes = 0

    def push_weights(self, model):
        self.pushes += 1

    def generate(self, tokenizer, prompts, seeds, **options):
        return list(seeds)


def test_a_batch_more_than_k_versions_old_is_dropped_and_the_next_taken(tiny_model, tokenizer):
    """A checkpoint's batch in flight, drawn by version 1, resumed at version 3 with K = 1 (staleness 2 = K + 1):
    dropped and counted; the next batch in data order comes instead (requested from the newest weights, with its
    own seeds)."""
    server = StandInServer()
    args = SimpleNamespace(seed=1, max_prompt_length=8, model_name_or_path=tiny_model, episodes=EpisodeArgs(),
                           model=ModelArgs(torch_dtype="float32"), rollouts=RolloutArgs(max_staleness=1))
    stream = RolloutStream(Accelerator(cpu=True), args, [], [], None, iter([[5, 6], [7, 8], [9, 10]]),
                           {"requested": 4, "in_flight": [(([3, 4], ["old"]), 1)]}, batch_size=2, model=None,
                           tokenizer=tokenizer, sampler=server, generate=None, logps=None)
    stream.draw = lambda indices, seeds, sample, tokenizer, accelerator: sample([[1]] * len(seeds), seeds)
    stream.publish(None, 3)
    assert server.pushes == 1
    indices, seeds = stream.next_batch(3)
    assert (indices, seeds) == ([5, 6], [10**9 + 4, 10**9 + 5]) and stream.dropped == 1
    assert stream.metrics()["async/dropped"] == 1 and stream.metrics()["async/staleness_max"] == 0
    stream.close()


@pytest.mark.parametrize("options, message", [
    (dict(max_staleness=1, use_vllm=True, vllm_mode="colocate"), "colocated vLLM engine"),
    (dict(max_staleness=2, use_vllm=True, vllm_mode="server"), "only between requests"),
    (dict(max_staleness=1, use_vllm=True, vllm_mode="server", vllm_importance_sampling_cap=2.0), "one ratio"),
    (dict(max_staleness=1, environment_factory="tests.toy_tools:Calculator"), "environments of batches in flight"),
    (dict(max_staleness=-1), "must be >= 0")])
def test_what_cannot_run_asynchronously_is_one_error(options, message):
    from algos import grpo
    args = script_args(grpo.Args, **options)
    with pytest.raises(UserError, match=message):
        check_features(args, Accelerator(cpu=True))


GRPO = ("grpo", ["--per_device_train_batch_size", "4", "--num_generations", "4", "--dynamic_sampling",
                 "--reward_funcs", "tests.toy_rewards:constant_for_odd_prompts"], ["loss", "async/importance_ratio"])
RLOO = ("rloo", ["--per_device_train_batch_size", "2", "--num_mini_batches", "2", "--rloo_k", "2",
                 "--reward_funcs", "tests.toy_rewards:short"], ["loss/policy_avg", "async/importance_ratio"])


def sharded(config: str) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", os.path.join(ROOT, "configs", config),
            "--num_processes", "2", "--mixed_precision", "no", "--dynamo_backend", "no"]


@pytest.mark.parametrize("launcher, script, flags, keys", [
    pytest.param(TWO_PROCESSES, *GRPO, marks=pytest.mark.multiproc, id="ddp-grpo"),
    pytest.param(TWO_PROCESSES, *RLOO, marks=pytest.mark.multiproc, id="ddp-rloo"),
    pytest.param(sharded("deepspeed_zero3.yaml"), *GRPO, marks=pytest.mark.deepspeed, id="zero3-grpo"),
    pytest.param(sharded("fsdp2.yaml"), *GRPO, marks=pytest.mark.fsdp, id="fsdp2-grpo")])
def test_two_processes_match_one_process_at_k_1(tmp_path, sft_model, launcher, script, flags, keys):
    """K = 1 on 2 gloo processes equals 1 process with 2 micro-batches: the same batches, drawn by the same
    versions (each rank's own copy of the policy samples its share; under ZeRO-3 and FSDP2 every rank gathers
    the weights it publishes, in step), the same staleness weights and losses; grpo with dynamic sampling,
    whose extra batches come from the same stream."""
    if "deepspeed" in " ".join(launcher):
        pytest.importorskip("deepspeed")
    common = [f"algos/{script}.py", "--max_steps", "3", "--logging_steps", "1", "--model_name_or_path", sft_model,
              "--max_completion_length", "8", "--reward_model_paths", "--max_staleness", "1", *flags]
    run_script(*common, "--gradient_accumulation_steps", "1", "--output_dir", str(tmp_path / "two"),
               launcher=launcher, env={**os.environ, "ACCELERATE_USE_CPU": "true"})
    run_script(*common, "--gradient_accumulation_steps", "2", "--output_dir", str(tmp_path / "one"))
    two, one = read_log(str(tmp_path / "two")), read_log(str(tmp_path / "one"))
    assert len(two) == len(one) == 3 and [r["async/staleness_max"] for r in one] == [0, 1, 1]
    for a, b in zip(two, one):
        for key in keys + ["async/staleness"]:  # grpo: extra batches of a rollout are drawn by its version
            assert a[key] == pytest.approx(b[key], abs=1e-5), (key, a[key], b[key])


@pytest.mark.realmodel
def test_the_benchmark_in_quick_mode(tmp_path):
    """benchmarks/async_rollouts.py end to end, a few steps each: the tiny task's chain and SmolLM2, K = 0 and 1
    interleaved, a row per task and K, the staleness of each run as its K makes it."""
    run_script("benchmarks/async_rollouts.py", "--max_steps", "3", "--seeds", "1", "--eval_prompts", "16",
               "--smollm2_steps", "3", "--repeats", "1", "--output_dir", str(tmp_path), "--results",
               str(tmp_path / "async.md"), timeout=1500)
    runs = json.load(open(tmp_path / "async.json"))["runs"]
    assert [(r["task"], r["k"]) for r in runs] == [("tiny", 0), ("tiny", 1), ("smollm2", 0), ("smollm2", 1)]
    assert all((r["staleness"] > 0) == (r["k"] == 1) and r["seconds_per_step"] > 0 for r in runs)
    table = (tmp_path / "async.md").read_text()
    assert "| tiny TL;DR, GRPO 50 x 32 | 1 |" in table and "| SmolLM2-135M arithmetic, GRPO 16/step | 1 |" in table


# ---- K = 1 with tools, a temperature and truncation: the behaviour's log-probs and a step's gradient ----------------

def calls_made(prompts, completions, **columns):
    """A reward: the tool results an episode got (TURNS: 0, 1 or 2; it differs within each group of 4)."""
    return [float(sum(m["role"] == "tool" for m in c)) for c in completions]


# each script its own temperature and truncation, so that a behaviour pass without either changes the numbers
SAMPLING = {"grpo": dict(temperature=0.7, top_k=20), "rloo": dict(temperature=1.3, top_p=0.9, min_p=0.02)}
CAP = 1.5  # binds on some tokens of update 1, not on others (asserted)


def k1_run(name: str, tmp_path, tiny_model) -> dict:
    """grpo.py or rloo.py, 2 steps at K = 1 with --tools (tests.toy_tools:multiply) and a scripted policy
    (episode j of the run: TURNS[j % 3], 0 to 2 calls; tests/test_episodes.py), one optimizer step per rollout at
    ratio 1 (mu = 1; rloo: 1 epoch, 1 mini-batch), a sampling temperature and truncation; rloo with a perturbed
    reference. Records the weights and gradient of every optimizer step (before clipping), each batch the sampler
    thread drew (its Samples, with sampler_logps) and the version that drew it, and the log."""
    from algos import grpo, rloo
    from common import rollouts
    from common.models import load_tokenizer
    from tests.first_step import perturbed_reference, write_splits
    from tests.test_episodes import TURNS, scripted

    module = {"grpo": grpo, "rloo": rloo}[name]
    template = tmp_path / "template.jinja"
    template.write_text(open(os.path.join(ROOT, "configs", "chatml_tools.jinja")).read().replace(
        "<|im_end|>", "<|endoftext|>"))
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} * 3 * 2?"}]} for i in range(4)]
    # max_prompt_length 24: the prompts' last tokens only (the tools' schemas make them long), so that the passes
    # worked out row by row here stay fast; the scripted policy reads nothing, the passes read what it was given
    common = dict(model_name_or_path=tiny_model, dataset_name=write_splits(tmp_path / "data", rows),
                  reward_model_paths=[], reward_funcs=["tests.test_async:calls_made"],
                  tools=["tests.toy_tools:multiply"],
                  chat_template_path=str(template), max_completion_length=300, per_device_train_batch_size=4,
                  learning_rate=2e-3, max_steps=2, max_prompt_length=24, logging_steps=1, max_staleness=1,
                  async_importance_sampling_cap=CAP, output_dir=str(tmp_path / "out"), **SAMPLING[name])
    args = script_args(module.Args, **common,
                       **(dict(beta=0.0, num_generations=4) if name == "grpo" else dict(num_ppo_epochs=1)))
    tokenizer = load_tokenizer(tiny_model, chat_template_path=str(template))
    sample, _ = scripted(tokenizer, [TURNS[j % 3] for j in range(3 * 4)])  # 3 batches: 2 trained, 1 drawn ahead
    steps, drawn, clip, draw = [], [], Accelerator.clip_grad_norm_, rollouts.RolloutStream._draw

    def record(self, parameters, max_norm, norm_type=2):
        parameters = list(parameters)
        (model,) = [m for m in self._models if any(p is parameters[0] for p in m.parameters())]
        names = {id(p): n for n, p in model.named_parameters()}
        steps.append({names[id(p)]: (p.detach().clone(), p.grad.detach().clone()) for p in parameters})
        return clip(self, parameters, max_norm, norm_type)

    def recording_draw(self, request, version):
        indices, episodes = draw(self, request, version)
        drawn.append(dict(version=version, samples=episodes.samples))
        return indices, episodes

    threads = torch.get_num_threads()
    torch._C.set_num_threads(1)  # as the one_torch_thread fixture
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(module, "generate", lambda model, tok, prompts, max_new_tokens, seeds, **_: sample(
                prompts, [s - args.seed * 10**9 for s in seeds], max_new_tokens))  # episode j of the run by its seed
            loaded = perturbed_reference(mp, module) if name == "rloo" else []
            mp.setattr(Accelerator, "clip_grad_norm_", record)
            mp.setattr(rollouts.RolloutStream, "_draw", recording_draw)
            module.main(args)
    finally:
        torch._C.set_num_threads(threads)
    # the batch requested ahead of a third step is drawn by version 1 (unless close() cancels it before it starts)
    assert len(steps) == 2 and [d["version"] for d in drawn] in ([0, 0], [0, 0, 1])
    return dict(args=args, steps=steps, drawn=drawn, ref=loaded[1] if loaded else None, tokenizer=tokenizer,
                log=read_log(args.output_dir))


@pytest.fixture(scope="module", params=["grpo", "rloo"])
def k1(request, tmp_path_factory, tiny_model):
    return k1_run(request.param, tmp_path_factory.mktemp(f"k1_{request.param}"), tiny_model)


def logits_of(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The logits before each of `tokens`, from one plain forward of prompt + tokens alone (every token before it
    attended to, tool results too)."""
    return model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()


def sampled_logps(logits, tokens: list[int], temperature: float, **truncation) -> torch.Tensor:
    """log q(token) of each of `tokens`, q: softmax(logits / temperature) over the tokens the sampler's truncation
    keeps (conftest.sampling_logprobs; the token itself counted as kept). With gradients."""
    z = logits / temperature
    with torch.no_grad():
        kept = torch.stack([sampling_logprobs(z[t], **truncation, label=y).isfinite() for t, y in enumerate(tokens)])
    return z.masked_fill(~kept, -math.inf).log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def episodes_of(samples) -> list[tuple[list[int], list[int], torch.Tensor]]:
    """Per episode: its prompt, every token after it (the model's and the tool results, contiguous) and 1.0 on the
    model's own tokens."""
    out = []
    for i in range(len(samples.completion_ids)):
        n = int(samples.completion_mask[i].sum())
        assert samples.completion_mask[i, :n].all()
        out.append((samples.prompt_ids[i][samples.prompt_mask[i].bool()].tolist(),
                    samples.completion_ids[i, :n].tolist(), samples.model_mask[i, :n].float()))
    return out


def test_k1_behaviour_logps_are_the_sampling_distributions_of_the_weights_that_drew_them(k1, tiny_model):
    """Each batch's sampler_logps (the copy's pass in the sampler thread) are, on every token of each episode,
    log q of the weights of the version that drew it (version 0, 0, then 1 for the one drawn ahead): the sampling's
    temperature and truncation, the tool results before a token attended to. Worked out row by row here; the numbers
    differ at temperature 1, without the truncation and with the other version's weights, so each is checked."""
    from tests.first_step import policy_with, weights_of

    args, truncation = k1["args"], {k: flags(k1["args"])[k] for k in ("top_k", "top_p", "min_p")}
    policies = [policy_with(tiny_model, k1["tokenizer"], weights_of(step)) for step in k1["steps"]]
    gaps = torch.zeros(3)
    for batch in k1["drawn"]:
        s, v, results = batch["samples"], batch["version"], 0
        for i, (prompt, tokens, own) in enumerate(episodes_of(s)):
            assert own[0] == own[-1] == 1  # the model's first and last turns, tool results between (some)
            results += int((own == 0).any())
            with torch.no_grad():
                z = logits_of(policies[v], prompt, tokens)
                expected = sampled_logps(z, tokens, args.temperature, **truncation)
                if i == 0:  # what a behaviour pass at temperature 1, untruncated or of the other version would give
                    others = [sampled_logps(z, tokens, 1.0, **truncation), sampled_logps(z, tokens, args.temperature),
                              sampled_logps(logits_of(policies[1 - v], prompt, tokens), tokens, args.temperature,
                                            **truncation)]
                    gaps = torch.maximum(gaps, torch.stack([(o - expected).abs().max() for o in others]))
            torch.testing.assert_close(s.sampler_logps[i, :len(tokens)], expected, atol=2e-5, rtol=0)
        assert results >= len(s.completion_ids) // 2  # episodes with tool results in every batch
    assert (gaps > 1e-2).all(), gaps


def test_k1_step_gradient_is_the_loss_written_out_with_the_capped_staleness_weight(k1, tiny_model):
    """The gradient of each step against the loss written out here on the batch it learnt from (the tools'
    results attended to, only the model's tokens trained), at ratio 1: -(1/N) sum_i A_i sum_t w_t grad log pi(o_t),
    N the model's tokens, w_t = min(pi_old(o_t) / pi_behaviour(o_t), cap) a constant (no gradient). Step 0
    (staleness 0): w = 1. Step 1 (drawn by version 0, trained at version 1): w from the two versions' weights,
    above 1 and below on different tokens (the inverse weight fails) and capped on some (checked as a term of its
    own: a cap dropped or a weight with a gradient fails). A: grpo's group z-score of the reward; rloo's reward
    minus kl_coef x sum_t (log pi_old - log pi_ref), minus the mean of the others of its prompt. The logged
    async/importance_ratio: the mean of the uncapped weight over the model's tokens."""
    import statistics

    from tests.first_step import assert_gradient, gradient, grads_of, policy_with, weights_of

    args, truncation = k1["args"], {k: flags(k1["args"])[k] for k in ("top_k", "top_p", "min_p")}
    behaviour = policy_with(tiny_model, k1["tokenizer"], weights_of(k1["steps"][0]))
    rloo, k = hasattr(args, "rloo_k"), getattr(args, "rloo_k", getattr(args, "num_generations", 0))
    for t, step in enumerate(k1["steps"]):
        policy = policy_with(tiny_model, k1["tokenizer"], weights_of(step))
        episodes = episodes_of(k1["drawn"][t]["samples"])
        logps = [sampled_logps(logits_of(policy, p, c), c, args.temperature, **truncation) for p, c, _ in episodes]
        with torch.no_grad():
            weights = [torch.exp(lp.detach() - sampled_logps(logits_of(behaviour, p, c), c, args.temperature,
                                                             **truncation)) for lp, (p, c, _) in zip(logps, episodes)]
            kl = [((lp.detach() - sampled_logps(logits_of(k1["ref"], p, c), c, args.temperature, **truncation)) * own
                   ).sum().item() if rloo else 0.0 for lp, (p, c, own) in zip(logps, episodes)]
        rewards = [float((own[1:] < own[:-1]).sum()) - getattr(args, "kl_coef", 0.0) * d  # a tool result per gap
                   for (_, _, own), d in zip(episodes, kl)]
        advantages = []
        for g in range(0, len(rewards), k):
            group = rewards[g:g + k]
            advantages += ([r - statistics.mean(group[:j] + group[j + 1:]) for j, r in enumerate(group)] if rloo else
                           [(r - statistics.mean(group)) / (statistics.stdev(group) + 1e-4) for r in group])
        own = [o for _, _, o in episodes]
        tokens = sum(o.sum() for o in own)
        ratios = torch.cat([w[o.bool()] for w, o in zip(weights, own)])
        if t == 0:
            assert torch.allclose(ratios, torch.ones_like(ratios), atol=1e-5)  # the same weights: w = 1
            terms = {"policy gradient": -sum(a * (lp * o).sum() for a, lp, o in zip(advantages, logps, own)) / tokens}
        else:
            deciles = ratios.quantile(torch.linspace(0, 1, 11))
            assert (ratios > CAP).any() and ((ratios < CAP) & (ratios > 1)).any() and (ratios < 1).any(), deciles
            terms = {name: -sum(a * (lp * o * part(w)).sum() for a, lp, o, w in zip(advantages, logps, own, weights))
                     / tokens for name, part in (("uncapped tokens", lambda w: w * (w <= CAP)),
                                                 ("capped tokens", lambda w: CAP * (w > CAP)))}
            assert k1["log"][1]["async/importance_ratio"] == pytest.approx(ratios.mean().item(), rel=1e-5)
        # rtol: rloo's A sums ~60 tokens' log-ratios, read from a padded batch by the script, row alone here
        assert_gradient(grads_of(step), {name: gradient(term, policy) for name, term in terms.items()}, rtol=3e-5)
    assert [row["async/staleness_max"] for row in k1["log"]] == [0, 1]


def test_a_failed_run_at_k_1_ends_without_waiting_for_the_sampler_thread():
    """K = 1: the batch requested ahead never finishes in the sampler's thread (a tool that hangs, with no
    --tool_timeout); the trainer then fails. The process must end with the trainer's error at once (before: the
    interpreter waited for concurrent.futures' worker, for ever)."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "sampler_exit_probe.py")], capture_output=True,
                          text=True, timeout=30, cwd=ROOT)  # ~4 s; a hung mutant: 30
    assert proc.returncode == 1 and "batch 0\n" in proc.stdout and "drawing ahead\n" in proc.stdout, proc.stdout
    assert proc.stderr.strip().endswith("RuntimeError: the trainer failed")

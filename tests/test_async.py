"""Asynchronous rollouts (--max_staleness K, common/rollouts.py): which weights draw each generation batch, the
staleness weight of the loss worked out here from those weights, the drop rule, the refusals; 2 processes equal 1
(multiproc marker; resume: tests/test_common_checkpoint.py)."""

import json
import os
import sys

import pytest
import torch
from accelerate import Accelerator

from common.rollouts import RolloutStream
from common.runtime import UserError
from common.vllm import sampler_options
from tests.conftest import ROOT, run_script
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
    from tests.first_step import own_logprobs, write_splits

    published, drawn, losses = {}, [], []
    publish, generate, loss = rollouts.RolloutStream.publish, grpo.generate, grpo.grpo_loss

    def recording_publish(self, model, version):
        published[version] = snapshot(self.accelerator.unwrap_model(model))
        return publish(self, model, version)

    def recording_generate(model, tokenizer, prompts, max_new_tokens, seeds, **options):
        out = generate(model, tokenizer, prompts, max_new_tokens, seeds=seeds, **options)
        drawn.append(dict(weights=snapshot(model), seeds=seeds, out=out))
        return out

    def recording_loss(logps, old_logps, ref_logps, advantages, mask, token_weights=1.0, **options):
        losses.append(dict(old=old_logps.detach().clone(), weights=token_weights, mask=mask.clone()))
        return loss(logps, old_logps, ref_logps, advantages, mask, token_weights=token_weights, **options)

    monkeypatch.setattr(rollouts.RolloutStream, "publish", recording_publish)
    monkeypatch.setattr(grpo, "generate", recording_generate)
    monkeypatch.setattr(grpo, "grpo_loss", recording_loss)
    rows = [{"prompt": f"SUBREDDIT: r/test POST: day {i} went {'well' if i % 2 else 'badly'}. TL;DR:"}
            for i in range(8)]
    cap, steps = 1.05, 3
    args = grpo.Args(model_name_or_path=tiny_model, dataset_name=write_splits(tmp_path / "data", rows),
                     reward_model_paths=[], reward_funcs=["tests.toy_rewards:short"], beta=0.0, max_steps=steps,
                     per_device_train_batch_size=8, num_generations=4, max_completion_length=6, learning_rate=1e-2,
                     max_staleness=k, async_importance_sampling_cap=cap, output_dir=str(tmp_path / "out"))
    grpo.main(args)

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
    stream = RolloutStream(
        Accelerator(cpu=True), lambda indices, seeds, sample, tokenizer, accelerator: sample([[1]] * len(seeds), seeds),
        iter([[5, 6], [7, 8], [9, 10]]),
        dict(seed=1, max_staleness=1, ds3_gather_for_generation=True, model_name_or_path=tiny_model,
             torch_dtype="float32"),
        {"requested": 4, "in_flight": [(([3, 4], ["old"]), 1)]}, batch_size=2, model=None, tokenizer=tokenizer,
        sampler=server, generate=None, logps=None)
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
    args = dict(seed=1, torch_dtype="auto", use_peft=False, use_vllm=False, vllm_mode="colocate",
                vllm_importance_sampling_cap=None, repetition_penalty=1.0) | options
    with pytest.raises(UserError, match=message):
        sampler_options(args, Accelerator(cpu=True))


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

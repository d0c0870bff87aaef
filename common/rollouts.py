"""The rollouts of grpo and rloo beyond their base path (one turn, HF generate, in turn, written in the script):
with vLLM (--use_vllm, common/vllm.py), multi-turn episodes (--tools / --environment_factory,
common/episodes.py), and generation batches drawn ahead of the update (--max_staleness K >= 1), in one
background thread, while the trainer updates on the batch before: the overlap of asynchronous RL (one-step-off
at K = 1).

The stream hands out generation batches in the data order of K = 0 (the same prompts, the same seeds); only the
weights that draw them differ. The script publishes its weights at every version boundary (a version: rollouts
trained so far); a batch is requested K rollouts before its own and drawn by the newest weights published then,
whatever is published meanwhile (so 1 and N processes, and a resumed run, draw alike). Its staleness, version now
minus its version, is then K (less while the first K rollouts fill the pipeline); an older one (a checkpoint's,
resumed with a smaller K) is dropped, counted and replaced by the next. Each batch comes with the behaviour
policy's log-probabilities (Samples.sampler_logps), for the scripts' staleness correction.

Samplers: a full copy of the policy sampling with HF generate (every rank its own, in its thread: no collective
call; published weights are a snapshot, so the copy never changes mid-batch; its log-probs are the script's own
per-token pass on the copy), or the vLLM server (an HTTP request in the thread; its log-probs are vLLM's; weights
move over NCCL, which every rank joins, so only while no request runs). A colocated engine shares the training
devices and cannot overlap (refused in check_staleness)."""

import contextlib
import copy
import dataclasses
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import tyro

from common.episodes import Episodes, run_episodes
from common.generation import Samples
from common.models import deepspeed_stage, load_policy
from common.runtime import UserError
from common.sampler_correction import check_correction
from common.vllm import full_parameters, sample_with, sampler_options


@tyro.conf.configure(tyro.conf.OmitArgPrefixes)  # --max_staleness, not --rollouts.max-staleness
@dataclass
class RolloutArgs:
    """asynchronous rollouts (common/rollouts.py)"""
    max_staleness: int = 0
    """K: draw generation batches up to K rollouts ahead, in a background thread, while updating (0: in turn)"""
    async_importance_sampling_cap: float = 2.0
    """K >= 1: upper bound of each token's staleness weight pi_old / pi_behaviour (truncated importance sampling)"""


def check_features(args, accelerator) -> tuple[dict | None, dict | None]:
    """Before anything loads, with --use_vllm or --max_staleness (args: grpo's or rloo's): their checks, vLLM there
    and its server up; the sampler-mismatch correction's options and the vLLM sampler's (None without --use_vllm)."""
    check_staleness(args.rollouts.max_staleness, accelerator, args)
    if not args.vllm.use_vllm:
        return None, None
    return (check_correction(args.correction, use_vllm=True, max_staleness=args.rollouts.max_staleness,
                             repetition_penalty=args.sampling.repetition_penalty),
            sampler_options(args.vllm, accelerator, seed=args.seed, dtype=args.model.torch_dtype,
                            use_peft=args.model.use_peft))


def check_staleness(k: int, accelerator, args):
    """Before anything loads: --max_staleness K and what it can run with (args: the script's, its groups)."""
    use_vllm, vllm_mode = args.vllm.use_vllm, args.vllm.vllm_mode
    use_peft, environment_factory = args.model.use_peft, args.episodes.environment_factory
    if k < 0:
        raise UserError(f"--max_staleness must be >= 0 (got {k})")
    if k and use_vllm and vllm_mode == "colocate":
        raise UserError("--max_staleness with a colocated vLLM engine: it shares the training devices, so generation "
                        "cannot overlap the update; use --vllm_mode server, or HF generate (no --use_vllm)")
    if k > 1 and use_vllm:
        raise UserError("--max_staleness > 1 with the vLLM server: its weights change only between requests, so one "
                        "request in flight (--max_staleness 1) is the whole overlap")
    if k and use_peft and deepspeed_stage(accelerator) == 3:
        raise UserError("--max_staleness with --use_peft under ZeRO-3: the sampler's copy cannot take gathered "
                        "LoRA weights; use ZeRO-2 (configs/deepspeed_zero2.yaml)")
    if k and environment_factory:
        raise UserError("--max_staleness with --environment_factory: the environments of batches in flight would have "
                        "to go into a checkpoint, which holds data only; use --tools, or --max_staleness 0")


class RolloutStream:
    """next_batch(version) -> (prompt indices, Episodes): the next generation batch of `batches` (this rank's share
    of each global batch of batch_size prompts, in data order), with one seed per completion from its place in the
    run (the same samples on 1 or N processes), drawn by `draw` (run_episodes of those rows, with `sampling`).
    K = 0: here and now (common.vllm.sample_with). K >= 1: in the sampler's thread (accelerator None: no other
    process to keep in step), and logps(policy, input_ids, attention_mask, prompt_width) of the HF copy become the
    episodes' sampler_logps. args: grpo's or rloo's (seed, max_prompt_length, the model to copy, its ModelArgs,
    EpisodeArgs and RolloutArgs)."""

    def __init__(self, accelerator, args, rows: list, prompt_ids: list, tools, batches, resumed: dict, *,
                 batch_size: int, model, tokenizer, sampler, generate, logps, **sampling):
        self.accelerator, self.batches, self.batch_size, self.seed = accelerator, batches, batch_size, args.seed
        self.rows, self.prompt_ids, self.tools = rows, prompt_ids, tools
        self.episode_options = dict(max_prompt_length=args.max_prompt_length,
                                    max_calls=args.episodes.max_tool_calling_iterations, **sampling)
        self.k, self.sampler, self.logps, self.generate = args.rollouts.max_staleness, sampler, logps, generate
        self.sample = sample_with(accelerator, model, tokenizer, sampler, gather=args.model.ds3_gather_for_generation,
                                  generate=generate)  # K = 0: the script's generate on the policy, or vLLM
        self.requested = resumed.get("requested", resumed.get("episode", 0))  # completions requested, every rank's
        self.pending = deque()  # [a future (finished: its result), the version that draws it], oldest first
        self.version, self.snapshots, self.copy_version = None, {}, None  # the newest published; version -> weights
        self.trainer_wait, self.sampler_wait, self.idle_since, self.reported = 0.0, 0.0, None, (0.0, 0.0)
        self.tokenizer, self.dropped = tokenizer, resumed.get("dropped", 0)
        self.staleness = list(resumed.get("staleness", []))  # of the batches taken since the last publish
        if self.k:
            self.pool = SamplerThread()
            self.tokenizer = copy.deepcopy(tokenizer)  # the thread's own: a Rust tokenizer is not shared safely
            if sampler is None:  # a full copy on every rank (ZeRO-3 / FSDP2 shard the policy, not this)
                plugin = accelerator.state.deepspeed_plugin
                with plugin.zero3_init_context_manager(enable=False) if plugin else contextlib.nullcontext():
                    self.policy = load_policy(args.model_name_or_path, tokenizer, args.model.torch_dtype)
                self.policy.eval().to(accelerator.device)
            self.pending.extend([_rebuilt(result), version] for result, version in resumed.get("in_flight", []))

    def draw(self, indices: list, seeds: list, sample, tokenizer, accelerator) -> Episodes:
        """The episodes of rows `indices` (a test may put another function in its place)."""
        return run_episodes(sample, tokenizer, [self.rows[i] for i in indices], self.tools, seeds=seeds,
                            prompt_ids=[self.prompt_ids[i] for i in indices], accelerator=accelerator,
                            **self.episode_options)

    def request(self):
        """The next batch's draw, a function of (sample, tokenizer, accelerator)."""
        indices, local = next(self.batches), self.batch_size // self.accelerator.num_processes
        seeds = [self.seed * 10**9 + self.requested + self.accelerator.process_index * local + j for j in range(local)]
        self.requested += self.batch_size
        return lambda sample, tokenizer, accelerator: (indices, self.draw(indices, seeds, sample, tokenizer,
                                                                          accelerator))

    def publish(self, model, version: int):
        """At a version boundary, on every rank (ZeRO-3 / FSDP2 gather each weight: a collective): the policy's
        weights become those the sampler draws its next batches from."""
        self.staleness = []
        if not self.k:  # K = 0: the vLLM sampler takes the new weights before its next batch
            if self.sampler is not None:
                self.sampler.needs_push |= version > 0
            return
        if self.sampler is not None:  # vLLM server: only between requests (none is in flight at K = 1)
            for entry in self.pending:
                entry[0] = self._wait(entry[0])
            self.sampler.push_weights(model)
        else:  # a snapshot, kept while a request drawn by it waits (the copy changes only between batches)
            with torch.no_grad():
                self.snapshots[version] = {n: t.detach().clone() for n, t in full_parameters(self.accelerator, model)}
            kept = {v for _, v in self.pending} | {version}
            self.snapshots = {v: w for v, w in self.snapshots.items() if v in kept}
        self.version = version

    def _draw(self, draw, version: int):
        """In the sampler's thread: the weights of `version` (the newest when it was requested), then the batch."""
        if self.idle_since is not None:
            self.sampler_wait += time.time() - self.idle_since  # waited for a request, i.e. for newer weights
        policy = None if self.sampler is not None else self.policy
        if policy is not None and version != self.copy_version:
            params = dict(policy.named_parameters())
            with torch.no_grad():
                for name, tensor in self.snapshots[version].items():
                    params[name].copy_(tensor)
            self.copy_version = version

        def sample(prompts, seeds, **options):  # as run_episodes calls it: the server, or HF generate on the copy
            if policy is None:
                return self.sampler.generate(self.tokenizer, prompts, seeds=seeds, **options)
            return self.generate(policy, self.tokenizer, prompts, seeds=seeds, **options)
        with torch.no_grad(), self.accelerator.autocast():  # thread-local both: as the trainer's forward
            result = draw(sample, self.tokenizer, None)
            if policy is not None:  # the behaviour policy's log-probs, as the trainer computes them
                s = result[-1].samples
                s.sampler_logps = self.logps(policy, torch.cat([s.prompt_ids, s.completion_ids], 1),
                                             torch.cat([s.prompt_mask, s.completion_mask], 1), s.prompt_ids.shape[1])
        self.idle_since = time.time()
        return result

    def _wait(self, item):
        if not hasattr(item, "result"):  # finished already (a checkpoint's)
            return item
        start = time.time()
        out = item.result()
        self.trainer_wait += time.time() - start
        return out

    def next_batch(self, version: int):
        if not self.k:
            self.staleness.append(0)
            return self.request()(self.sample, self.tokenizer, self.accelerator)
        while True:
            while len(self.pending) < self.k + 1:  # this batch and the next K, requested in data order
                self.pending.append([self.pool.submit(self._draw, self.request(), self.version), self.version])
            item, drawn_by = self.pending.popleft()
            result = self._wait(item)
            if version - drawn_by <= self.k:
                self.staleness.append(version - drawn_by)
                return result
            self.dropped += 1  # too stale (e.g. a checkpoint's, resumed with a smaller K); every rank alike

    def state(self) -> dict:
        """For a checkpoint: completions requested, and the batches requested and not yet taken, finished, as data
        (the resumed run takes them as they are, drawn by the weights that drew them in the uninterrupted run);
        what metrics() reports of the rollout under way and of the run so far."""
        for entry in self.pending:
            entry[0] = self._wait(entry[0])
        return {"requested": self.requested, "in_flight": [(_plain(result), v) for result, v in self.pending],
                "staleness": self.staleness, "dropped": self.dropped}

    def metrics(self) -> dict:
        """vllm/push_seconds; async/*: the staleness of the batches taken since the last publish (this rollout's),
        batches dropped so far, and the seconds the trainer waited for batches and the sampler for requests (that
        is, for newer weights) since the last call."""
        if not self.k:
            return {"vllm/push_seconds": self.sampler.push_seconds} if self.sampler is not None else {}
        now, staleness = (self.trainer_wait, self.sampler_wait), self.staleness
        before, self.reported = self.reported, now
        return {"async/staleness": sum(staleness) / len(staleness), "async/staleness_max": max(staleness),
                "async/dropped": self.dropped, "async/trainer_wait_seconds": now[0] - before[0],
                "async/sampler_wait_seconds": now[1] - before[1]} | (
            {"vllm/push_seconds": self.sampler.push_seconds} if self.sampler is not None else {})

    def close(self):
        """A finished run: the batches requested ahead are not drawn; the one being drawn is waited for."""
        if self.k:
            for future, _ in self.pending:
                if isinstance(future, Future):  # else a checkpoint's batch, finished already
                    future.cancel()
            self.pool.close()


class SamplerThread(threading.Thread):
    """The sampler's thread: the draws submitted, one at a time, in order. A daemon, so that a run that fails or is
    stopped (an exception, a signal) ends without waiting for the batch being drawn (a hung tool's, a long one's),
    which concurrent.futures' workers would make the interpreter wait for, and then for every batch requested."""

    def __init__(self):
        super().__init__(name="sampler", daemon=True)
        self.jobs = queue.SimpleQueue()
        self.start()

    def submit(self, fn, *args) -> Future:
        future = Future()
        self.jobs.put((future, fn, args))
        return future

    def run(self):
        while (job := self.jobs.get()) is not None and threading.main_thread().is_alive():
            future, fn, args = job
            if future.set_running_or_notify_cancel():  # not cancelled
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # raised in the trainer's thread, where it waits for the batch
                    future.set_exception(e)

    def close(self):
        self.jobs.put(None)
        self.join()


def _plain(x):
    """x with its Episodes / Samples as dicts: a checkpoint holds data only (no class is unpickled from one)."""
    if isinstance(x, (Episodes, Samples)):
        return {"dataclass": type(x).__name__} | {f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    return type(x)(_plain(v) for v in x) if isinstance(x, (list, tuple)) else x


def _rebuilt(x):
    if isinstance(x, dict) and x.get("dataclass") in ("Episodes", "Samples"):
        cls = Episodes if x["dataclass"] == "Episodes" else Samples
        return cls(**{k: _rebuilt(v) for k, v in x.items() if k != "dataclass"})
    return type(x)(_rebuilt(v) for v in x) if isinstance(x, (list, tuple)) else x

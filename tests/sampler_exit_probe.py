"""`python tests/sampler_exit_probe.py`: a RolloutStream at K = 1 whose second batch, drawn ahead in the sampler's
thread, never finishes (a tool that hangs, with no --tool_timeout); the trainer then fails. The process must end
with the trainer's error, not wait for the sampler (tests/test_async.py)."""

import contextlib
import itertools
import os
import sys
import threading
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.episodes import EpisodeArgs  # noqa: E402
from common.models import ModelArgs  # noqa: E402
from common.rollouts import RolloutArgs, RolloutStream  # noqa: E402

accelerator = types.SimpleNamespace(num_processes=1, process_index=0, autocast=contextlib.nullcontext)
never = threading.Event()


def draw(indices, seeds, sample, tokenizer, accelerator):
    if indices[0] > 0:  # the batch requested ahead
        sys.stdout.write("drawing ahead\n")  # one write: the trainer's thread prints too
        sys.stdout.flush()
        never.wait()
    return f"batch {indices[0]}"


args = types.SimpleNamespace(seed=1, max_prompt_length=8, model=ModelArgs(), episodes=EpisodeArgs(),
                             rollouts=RolloutArgs(max_staleness=1))
stream = RolloutStream(accelerator, args, [], [], None, ([i] for i in itertools.count()), {}, batch_size=1, model=None,
                       tokenizer=None, sampler=types.SimpleNamespace(push_weights=lambda model: None), generate=None,
                       logps=None)
stream.draw = draw
stream.publish(None, 0)
sys.stdout.write(stream.next_batch(0)[1] + "\n")
sys.stdout.flush()
raise RuntimeError("the trainer failed")

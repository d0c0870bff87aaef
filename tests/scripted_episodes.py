"""`python tests/scripted_episodes.py <grpo|rloo|gkd> <flags>`: the script with its policy's turns scripted
(tests/test_episodes.py's stand-in), so that a launcher can run it on several processes: episode j of the run
(by its seed) has TURNS[j % 3] if j % 16 < 8, else TURNS[j % 2], so with batches of 16 split over 2 processes
rank 0's episodes take up to 3 turns and rank 1's up to 2 (gkd deals a batch's rows out in turn: both ranks get
some of each)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tyro  # noqa: E402

from algos import gkd, grpo, rloo  # noqa: E402
from common.runtime import exit_on_user_error, stop_on_signal  # noqa: E402
from tests.test_episodes import TURNS, scripted  # noqa: E402


class Replies:
    def __getitem__(self, j: int) -> list[str]:
        return TURNS[j % 3] if j % 16 < 8 else TURNS[j % 2]


if __name__ == "__main__":
    module = {"grpo": grpo, "rloo": rloo, "gkd": gkd}[sys.argv[1]]
    args = tyro.cli(module.Args, args=sys.argv[2:])

    def generate(model, tokenizer, prompts, max_new_tokens, seeds, **_):
        sample, _ = scripted(tokenizer, Replies())
        return sample(prompts, [s - args.seed * 10**9 for s in seeds], max_new_tokens)

    module.generate = generate
    with exit_on_user_error(), stop_on_signal():
        module.main(args)

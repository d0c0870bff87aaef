"""TRL's reward-function contract beyond prompts, completions and columns, entered where a --reward_funcs function
asks for it: names one of the arguments below, takes **kwargs (as TRL's docs advise) or is `async def`
(common.rewards.asks_for_extras; without one, common/rewards.py calls the functions plainly). Each function whose
signature names them, or takes **kwargs, is given

  trainer_state              the run's progress, transformers' TrainerState: global_step (updates done), max_steps,
                             epoch (passes over the prompts); a curriculum reads it
  log_metric(name, value)    a scalar logged under `name`: the mean of the step's values on each process, then the
                             mean over the processes
  log_extra(column, values)  a column of the samples table, one value per completion of this process's batch

and `async def` functions are awaited together, on the run's event loop (common/event_loop.py: a client a
function keeps between calls stays on the loop it was made on)."""

import asyncio
import inspect
import math
from collections import defaultdict

import torch
from accelerate.utils import gather_object

from common.event_loop import awaited
from common.rewards import called
from common.runtime import UserError


def takes(fn, name: str) -> bool:
    """Whether fn's signature names the keyword `name` or takes **kwargs."""
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())


class RewardExtras:
    """Made where common.rewards.asks_for_extras(--reward_funcs); its `caller` is compute_rewards' `call`."""

    def __init__(self, accelerator, args, epoch_size: int, table: bool = True):
        """args: the script's (max_steps, reward_timeout; grpo's dynamic_sampling); epoch_size: completions in a pass
        over the prompts (their whole batches: a pass's leftover prompts are dropped); table: log_extra's columns go to
        the samples table (not where its rows are not the batch scored last: grpo's --dynamic_sampling reorders it)."""
        self.accelerator, self.max_steps, self.epoch_size = accelerator, args.max_steps, epoch_size
        self.timeout = args.reward_timeout  # for each function, and for the async ones awaited together
        self.table = table and not getattr(args, "dynamic_sampling", False)
        self.metrics, self.columns = defaultdict(list), {}  # log_metric's since the last flush; log_extra's

    def caller(self, step: int, taken: int):
        """compute_rewards' `call` for a batch scored after `step` updates and `taken` completions."""
        from transformers import TrainerState

        self.columns = {}
        state = TrainerState(global_step=step, max_steps=self.max_steps, epoch=taken / self.epoch_size)
        extras = dict(trainer_state=state, log_metric=self.log_metric, log_extra=self.log_extra)

        def call(sources: list, kwargs: dict) -> dict:  # the functions of sources (no tokenizer: not a model)
            returned = {}
            for name, fn, tokenizer in sources:
                if tokenizer is None:  # not a model
                    asked = {k: v for k, v in extras.items() if takes(fn, k)}
                    returned[name] = called(name, fn, kwargs | asked, self.timeout)
            pending = [name for name, values in returned.items() if inspect.isawaitable(values)]
            if pending:  # awaited together, within the same time limit as one function
                done = called(", ".join(pending), awaited, {}, self.timeout,
                              args=(together(*(returned[name] for name in pending)),),
                              what="the async reward functions")
                for name, values in zip(pending, done):
                    if isinstance(values, BaseException):  # as common.rewards.called says it
                        raise UserError(f"reward function '{name}' raised {type(values).__name__}: {values}")
                    returned[name] = values
            return returned
        return call

    def log_metric(self, name: str, value: float):
        self.metrics[str(name)].append(float(value))

    def log_extra(self, column: str, values: list):
        self.columns[column] = list(values)

    def flush(self) -> dict:
        """{name: value} of log_metric since the last flush, the same on every process; a collective (every rank
        calls it: a name logged on some ranks only is the mean over those)."""
        names = sorted(set().union(*gather_object([sorted(self.metrics)])))
        means = [sum(v) / len(v) if (v := self.metrics.get(name)) else math.nan for name in names]
        self.metrics.clear()
        if not names:
            return {}
        gathered = self.accelerator.gather(torch.tensor([means], device=self.accelerator.device))
        return dict(zip(names, gathered.nanmean(0).tolist()))

    def rows(self, n: int) -> list[dict]:
        """The log_extra columns' values of the first n completions of this process's last scored batch."""
        return [{column: values[i] for column, values in self.columns.items() if i < len(values)} if self.table else {}
                for i in range(n)]


async def together(*calls):
    return await asyncio.gather(*calls, return_exceptions=True)

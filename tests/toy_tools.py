"""Tools and environments for the multi-turn tests (`--tools tests.toy_tools:multiply`,
`--environment_factory tests.toy_tools:Calculator` or its function factory `make_calculator`; Capitals beside it)."""

import asyncio
import threading

LOOPS = []  # the running event loop of each await below, in order (one for the run: common/event_loop.py)


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def broken(x: int) -> int:
    """A tool that always fails.

    Args:
        x: anything
    """
    raise RuntimeError("the tool is broken")


class Calculator:
    """One per episode: counts the multiplications asked of it; its reward is that count."""

    def reset(self, **row) -> str:
        self.used = 0
        return " (a calculator is available)"

    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: the first factor
            b: the second factor
        """
        self.used += 1
        return a * b

    def get_reward(self) -> float:
        return float(self.used)


class ResetRaises(Calculator):
    """An environment whose reset() raises on every row (test_episodes: one line naming it, not a traceback)."""

    def reset(self, **row) -> str:
        raise ValueError(f"no task for {row['answer']}")


RESET_RELEASE = threading.Event()  # set: SlowReset's reset returns at once (the tests' stand-in exit_now sets it)


class SlowReset(Calculator):
    """An environment whose reset() takes a second (--tool_timeout's watchdog fires first where it is shorter)."""

    def reset(self, **row) -> str:
        RESET_RELEASE.wait(1.0)
        return super().reset(**row)


async def add_later(a: int, b: int) -> int:
    """Add two integers, after a moment's wait (an async tool, which TRL awaits).

    Args:
        a: the first term
        b: the second term
    """
    await asyncio.sleep(0.01)
    LOOPS.append(asyncio.get_running_loop())
    return a + b


async def never_answers() -> str:
    """An async tool that never answers."""
    await asyncio.Event().wait()


class AsyncLedger:
    """An environment whose tool and get_reward are async (TRL awaits both); its reward is the balance."""

    def reset(self, **row) -> None:
        self.balance = 0

    async def deposit(self, amount: int) -> int:
        """Deposit an amount; returns the balance.

        Args:
            amount: how much
        """
        await asyncio.sleep(0)
        LOOPS.append(asyncio.get_running_loop())
        self.balance += amount
        return self.balance

    async def get_reward(self) -> float:
        LOOPS.append(asyncio.get_running_loop())
        return float(self.balance)


def broken_factory() -> Calculator:
    """An environment factory that raises (test_episodes: one line naming it)."""
    raise RuntimeError("no calculator today")


def slow_factory() -> Calculator:
    """An environment factory that takes a second (--tool_timeout's watchdog fires first where it is shorter)."""
    RESET_RELEASE.wait(1.0)
    return Calculator()


def make_calculator() -> Calculator:
    """An environment factory that is a function, not a class (TRL takes any callable)."""
    return Calculator()


class Capitals:
    """A second environment (`--environment_factory calc=tests.toy_tools:Calculator capitals=tests.toy_tools:Capitals`,
    each row's `environment` field picking one): looks capitals up; its reward is the count of lookups."""

    def reset(self, **row) -> None:
        self.looked, self.reset_with = 0, sorted(row)

    def capital(self, country: str) -> str:
        """The capital city of a country.

        Args:
            country: the country's English name
        """
        self.looked += 1
        return {"France": "Paris", "Japan": "Tokyo"}.get(country, "unknown")

    def get_reward(self) -> float:
        return float(self.looked)


class Quiz:
    """Environment-owned data (`--dataset_name ""`): each reset() draws the next task of the run (a count shared by
    every instance) and returns it as the prompt; its reward is 1 when multiply was asked its own factors."""
    asked = 0  # tasks handed out so far, over every instance

    def reset(self, **row) -> str:
        Quiz.asked += 1
        self.task, self.right = (Quiz.asked, Quiz.asked + 1), False
        return f"What is {self.task[0]} * {self.task[1]}?"

    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: the first factor
            b: the second factor
        """
        self.right = self.right or (a, b) == self.task
        return a * b

    def get_reward(self) -> float:
        return float(self.right)


MADE = []  # environments calculator_or_capitals made


def calculator_or_capitals():
    """A factory whose environments differ in class (TRL takes any callable): a Calculator, then Capitals, in turn."""
    MADE.append(Capitals() if len(MADE) % 2 else Calculator())
    return MADE[-1]

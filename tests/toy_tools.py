"""Tools and an environment for the multi-turn tests (`--tools tests.toy_tools:multiply`,
`--environment_factory tests.toy_tools:Calculator` or its function factory `make_calculator`)."""


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


def make_calculator() -> Calculator:
    """An environment factory that is a function, not a class (TRL takes any callable)."""
    return Calculator()

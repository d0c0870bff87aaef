"""The tiny TL;DR chain's figures (matplotlib, no display needed): gold win rate per algorithm, reward
and KL along training of the online runs, and RM score against gold score along training."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"sft": "tab:gray", "dpo": "tab:blue", "kto": "tab:cyan", "grpo": "tab:orange", "rloo": "tab:green",
          "online_dpo": "tab:purple", "ppo": "tab:red"}


def save(fig, path: str):
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (the first points average what there is)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def win_rate_bars(labels: list[str], names: list[str], rates: list[float], errors: list[float],
                  per_seed: list[list[float]], error_label: str, path: str):
    """One bar per policy with its error bar, the single seeds as dots, a line at 50%."""
    fig, ax = plt.subplots(figsize=(8, 4))
    x = range(len(labels))
    bars = ax.bar(x, [100 * r for r in rates], yerr=[100 * e for e in errors], capsize=4,
                  color=[COLORS.get(n, "tab:gray") for n in names], alpha=0.8)
    ax.bar_label(bars, [f"{100 * r:.1f}%" for r in rates], label_type="center", fontsize=8)
    if max(len(s) for s in per_seed) > 1:
        for i, seeds in enumerate(per_seed):
            ax.plot([i] * len(seeds), [100 * r for r in seeds], "k.", markersize=4)
    ax.axhline(50, color="k", linestyle="--", linewidth=1, label="tie with the references")
    ax.set_xticks(list(x), labels, rotation=20, ha="right")
    ax.set_ylabel("gold win rate vs references (%)")
    ax.set_ylim(0, 100)
    ax.set_title(f"Tiny TL;DR: greedy test summaries ({error_label})", fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    save(fig, path)


def training_curves(runs: dict[str, list[list[dict]]], keys: dict[str, tuple[str, str]], path: str):
    """Reward (top row) and KL (bottom row) against completions sampled, one column per online
    algorithm, one line per seed. runs: {name: [step records of each seed]}; keys: {name:
    (reward key, KL key)}; each panel names the key it shows, since the scripts define KL differently."""
    fig, axes = plt.subplots(2, len(runs), figsize=(4 * len(runs), 6), sharey="row", squeeze=False)
    for col, (name, seeds) in enumerate(runs.items()):
        for row, key in enumerate(keys[name]):
            ax = axes[row][col]
            for records in seeds:
                x, y = [r["episode"] for r in records], [r[key] for r in records]
                ax.plot(x, y, color=COLORS[name], alpha=0.25, linewidth=0.8)
                ax.plot(x, smooth(y, max(1, len(y) // 10)), color=COLORS[name], linewidth=1.5)
            ax.set_title(f"{name}: {key}", fontsize=9)
            ax.set_xlabel("completions sampled")
            ax.tick_params(labelleft=True)
        axes[0][col].set_ylabel("RM score of samples" if col == 0 else "")
        axes[1][col].set_ylabel("KL to SFT (as logged)" if col == 0 else "")
    fig.suptitle("Online runs along training (thin: per step; thick: moving average over a tenth of the steps). "
                 "KL as each script logs it: grpo's kl is the per-token k3 mean, objective/kl the per-sequence sum "
                 "of log pi - log pi_ref", fontsize=9)
    save(fig, path)


def rm_vs_gold(runs: dict[str, list[list[dict]]], keys: dict[str, str], path: str):
    """Gold score against RM score of the sampled completions along training, each point the mean over
    a tenth of the steps (a circle marks the first): over-optimisation shows as the gold score falling
    while the RM score still rises."""
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for name, seeds in runs.items():
        for i, records in enumerate(seeds):
            n = len(records)
            tenths = [records[j * n // 10:max(j * n // 10 + 1, (j + 1) * n // 10)] for j in range(min(10, n))]
            x = [sum(r[keys[name]] for r in part) / len(part) for part in tenths]
            y = [sum(r["rewards/gold_reward/mean"] for r in part) / len(part) for part in tenths]
            ax.plot(x, y, ".-", color=COLORS[name], linewidth=1.2, label=name if i == 0 else None)
            ax.plot(x[:1], y[:1], "o", color=COLORS[name], markersize=6)
    ax.set_xlabel("reward model score of the sampled completions")
    ax.set_ylabel("gold score of the same completions")
    ax.set_title("Along training, each point a tenth of the steps (circle: the first)", fontsize=10)
    ax.legend(fontsize=8)
    save(fig, path)


def sample_efficiency(runs: dict[str, list[list[dict]]], oracle: float, path: str):
    """Gold score of the sampled completions against completions sampled, one line per online
    algorithm (moving average over a tenth of the steps, then the mean over seeds; thin: each seed)."""
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for name, seeds in runs.items():
        curves = [smooth([r["rewards/gold_reward/mean"] for r in records], max(1, len(records) // 10))
                  for records in seeds]
        x = [r["episode"] for r in seeds[0]]
        n = min(len(c) for c in curves)
        if len(seeds) > 1:
            for c in curves:
                ax.plot(x[:n], c[:n], color=COLORS[name], alpha=0.3, linewidth=0.8)
        ax.plot(x[:n], [sum(c[i] for c in curves) / len(curves) for i in range(n)], color=COLORS[name], label=name)
    ax.axhline(oracle, color="k", linestyle="--", linewidth=1, label="oracle (gold-optimal)")
    ax.set_xlabel("completions sampled")
    ax.set_ylabel("gold score of the sampled completions")
    ax.set_title("Sample efficiency of the online methods (equal budgets)", fontsize=10)
    ax.legend(fontsize=8)
    save(fig, path)


def frontier(paths: dict[str, dict[float, list[tuple]]], sft: float, oracle: float, path: str):
    """Gold score against KL(pi || SFT), one panel per method and in it one line per KL strength through
    the run's checkpoints (paths: {method: {scale: [(step, kl, gold score), ...]}}, the first point the
    SFT model at KL 0, the last the final model, labelled with its scale), the oracle's gold score as a line."""
    fig, axes = plt.subplots(2, 3, figsize=(11, 6.5), sharex=True, sharey=True)
    styles = ["o:", "o-", "o--", "o-."]
    for ax, (name, runs) in zip(axes.flat, paths.items()):
        for style, (scale, pts) in zip(styles, sorted(runs.items())):
            ax.plot([p[1] for p in pts], [p[2] for p in pts], style, color=COLORS[name], markersize=3,
                    label=f"x{scale:g}")
            ax.annotate(f"x{scale:g}", pts[-1][1:], fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.plot([0], [sft], "s", color=COLORS["sft"])
        ax.axhline(oracle, color="k", linestyle="--", linewidth=1)
        ax.set_title(name, fontsize=10)
        ax.set_xscale("symlog", linthresh=0.1)
        ax.legend(fontsize=7, title="KL strength", title_fontsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("KL(policy || SFT) per summary (nats)")
    for ax in axes[:, 0]:
        ax.set_ylabel("gold score (greedy)")
    fig.suptitle("KL-reward frontier along training (square: SFT; dashed: oracle; a point every fifth of the steps)",
                 fontsize=10)
    save(fig, path)


def overoptimisation(runs: dict[str, list[dict]], reward_key: str, path: str):
    """The reward model's score (left) and the gold score (right) of the sampled completions against
    completions sampled, one line per run (moving average over a tenth of the steps)."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for (name, records), color in zip(runs.items(), ["tab:red", "tab:blue", "tab:green", "tab:orange"]):
        x = [r["episode"] for r in records]
        for ax, key in zip(axes, (reward_key, "rewards/gold_reward/mean")):
            y = [r[key] for r in records]
            ax.plot(x, y, color=color, alpha=0.2, linewidth=0.8)
            ax.plot(x, smooth(y, max(1, len(y) // 10)), color=color, label=name)
    axes[0].set_ylabel("reward model score of the samples (its own RM)")
    axes[1].set_ylabel("gold score of the same samples")
    for ax in axes:
        ax.set_xlabel("completions sampled")
        ax.legend(fontsize=8)
    fig.suptitle("Over-optimisation: GRPO without KL pushes its reward model's score up; the gold score "
                 "shows what that buys", fontsize=10)
    save(fig, path)

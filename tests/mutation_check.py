"""Mutation check: do the tests fail when the code is wrong? Each entry of MUTATIONS is a plausible
one-line bug (the classic ones of this kind of code: labels off by one, the temperature dropped,
a value read a position late, chosen and rejected swapped, a KL sign, loss scaling under gradient
accumulation, ...). Each is applied alone to a copy of the project, and the tests named with it run
there; the bug counts as caught when they fail. Before that, the same tests must pass on the
unchanged copy, or a failure would prove nothing.

    python tests/mutation_check.py              # every mutation; a table of bug -> failing test, time
    python tests/mutation_check.py --only 3 7   # some of them (numbers as in the table)
    python -m pytest -m mutation                # the same, as a test (every bug must be caught)

Two mutations run at a time (--jobs), each in its own copy, each pytest on one torch thread: two processes
of two threads each on a 2-core machine would wait on each other. Most of a row's time was its pytest
importing torch, transformers, accelerate and datasets (2026-11-28: 29 s of a 28 s row's wall time was
collection, 17 s of CPU); so each row's pytest is forked from a server that imported them once
(multiprocessing's forkserver, preloaded with the rows' test modules) and forgets the project's own modules
before it runs, so that it imports them, mutated or not, from its copy.
"""

import argparse
import multiprocessing
import os
import queue
import re
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PASSES = "tests/test_per_token_passes.py"
STEP = "test_default_first_step_gradient_against_the_loss_written_out"
GRPO_STEP = "tests/test_grpo.py::test_default_first_step_gradient_is_policy_gradient_plus_kl_of_scored_rows"
PPO_STEP = "tests/test_ppo.py::test_default_first_step_gradient_against_gae_and_whitening_written_out"
RLOO_STEP = "tests/test_rloo.py::test_first_step_gradient_against_the_advantages_written_out"
DPO_BCO = "tests/test_dpo.py::test_bco_pair_running_mean_of_the_rewards_of_earlier_steps"
ASYNC_VERSIONS = "tests/test_async.py::test_update_t_learns_from_a_batch_drawn_by_the_weights_of_version_t_minus_k"
ASYNC_DROP = "tests/test_async.py::test_a_batch_more_than_k_versions_old_is_dropped_and_the_next_taken"
EPISODES = "tests/test_episodes.py::"
SEVERAL = [EPISODES + "test_several_environments_each_rows_own_instance_tools_reset_and_reward"]
EXTRAS = "tests/test_reward_extras.py::"
EXTRAS_STATE = EXTRAS + "test_trainer_state_log_metric_and_log_extra_reach_the_functions_that_ask_for_them"
NO_DATASET = EPISODES + "test_without_a_dataset_each_prompt_is_what_reset_returns_and_max_steps_ends_the_run"
EPISODES_ROOM = EPISODES + "test_episodes_with_different_room_left_share_a_call_and_each_is_cut_at_its_own_room"
EPISODES_FAMILIES = (EPISODES + "test_each_familys_template_is_tried_at_start_up_and_appends_tool_results_as_it_"
                                 "renders_them")
EPISODES_TOOL_LIMITS = (EPISODES + "test_a_tool_that_hangs_answers_an_error_after_the_timeout_and_a_huge_result_is_"
                                   "cut_before_tokenising")
DCP_REFUSED = "tests/test_common_checkpoint.py::test_dcp_metadata_that_would_run_code_is_refused"
STEPS_PAST_9 = "tests/test_common_checkpoint.py::test_steps_past_9_are_ordered_by_number_when_pruned_and_resumed"
VLLM = "tests/test_common_vllm.py::"
ASYNC_LOGPS = ("tests/test_async.py::test_k1_behaviour_logps_are_the_sampling_distributions_of_the_weights_that_"
               "drew_them")
ASYNC_STEP = "tests/test_async.py::test_k1_step_gradient_is_the_loss_written_out_with_the_capped_staleness_weight"
GRPO_STATS = "tests/test_grpo.py::test_loss_statistics_kl_and_clipped_shares_hand_worked"
GKD = "tests/test_gkd.py::"
TOOL_USE = "tests/test_tool_use.py::"
HANG = "tests/test_common_rewards.py::test_a_reward_function_that_hangs_ends_the_process_with_one_line_naming_it"
TIMEOUT_REACHES = "tests/test_common_rewards.py::test_every_script_gives_its_reward_functions_and_judge_reward_timeout"
RESET = EPISODES + "test_an_environment_factory_or_reset_that_raises_or_hangs_ends_in_one_line_naming_it"
ASYNC_TOOLS = EPISODES + "test_async_tools_environment_methods_and_get_reward_are_awaited_on_the_runs_one_loop"
TIMEOUT_FLAGS = ("tests/test_common_rewards.py::test_the_timeouts_0_is_no_limit_and_below_0_is_refused_before_"
                 "anything_loads")
PACKED = "tests/test_packing.py::"
GKD_BACKWARD = GKD + "test_backward_under_a_mask_and_weights_is_autograd_of_the_definition"
GKD_DRAW = GKD + "test_on_and_off_policy_prompts_follow_the_global_draw"

# (file, text, replacement, the bug in words, tests that must fail). `text` occurs exactly once in `file`.
ONLINE_DPO_BATCHES = (
    "tests/test_online_dpo.py::test_each_process_takes_every_world_size_th_prompt_of_the_same_shuffled_global_batch")
RLOO_BASE = (
    "tests/test_rloo.py::test_the_base_path_seeds_each_completion_by_its_place_and_scores_conversations_as_messages")
MUTATIONS = [
    ("common/generation.py", "logps = token_logprobs(logits, input_ids[:, prompt_width:], temperature, **truncation)",
     "logps = token_logprobs(logits, input_ids[:, prompt_width:], **truncation)",
     "common: completion log-probabilities (grpo's, rloo's) without the sampling temperature",
     [PASSES + "::test_completion_logps_and_entropy_equal_each_rows_own_forward"]),
    ("common/generation.py", "logps = token_logprobs(logits, input_ids[:, prompt_width:], temperature, **truncation)",
     "logps = token_logprobs(logits, input_ids[:, prompt_width - 1:-1], temperature, **truncation)",
     "common: completion labels shifted by one token",
     [PASSES + "::test_completion_logps_and_entropy_equal_each_rows_own_forward"]),
    ("algos/rloo.py", "args.temperature, entropy=True, **truncation)", "1.0, entropy=True, **truncation)",
     "rloo: the training pass without the sampling temperature",
     ["tests/test_rloo.py::test_first_step_gradient_against_the_advantages_written_out"]),
    ("algos/ppo.py", "values = self.value_model.score(hidden[:, prompt_width - 1:-1]).squeeze(-1)",
     "values = self.value_model.score(hidden[:, prompt_width:]).squeeze(-1)",
     "ppo: value head read one position late",
     [PASSES + "::test_ppo_rollout_pass_reads_policy_reference_and_value_before_each_response_token"]),
    ("algos/ppo.py", "share_prefix=False), response_ids[s], temperature)",
     "share_prefix=False), response_ids[s])",
     "ppo: reference log-probabilities without the temperature",
     [PASSES + "::test_ppo_rollout_pass_reads_policy_reference_and_value_before_each_response_token"]),
    ("algos/kto.py", "kl_logps = logps_from(policy, build(mismatched, pad_id), device,",
     "kl_logps = logps_from(policy, build(rows, pad_id), device,",
     "kto: KL reference point from the rows' own completions",
     [PASSES + "::test_kto_kl_logratios_score_each_prompt_with_the_previous_rows_completion"]),
    ("algos/kto.py", "desirable = 1 - torch.sigmoid(beta * (ratio - kl))",
     "desirable = 1 - torch.sigmoid(beta * (kl - ratio))",
     "kto: KL reference point with the wrong sign for desirable rows",
     ["tests/test_kto.py::test_kto_loss_hand_derived"]),
    ("algos/online_dpo.py", "return first + chosen, first + 1 - chosen, ranked",
     "return first + 1 - chosen, first + chosen, ranked",
     "online_dpo: chosen and rejected swapped",
     [PASSES + "::test_online_dpo_pairs_take_the_judges_pick_and_the_higher_score_as_chosen"]),
    ("algos/online_dpo.py", "return torch.tensor([[1.0 - p, float(p)] for p in picks]).flatten()",
     "return torch.tensor([[float(p), 1.0 - p] for p in picks]).flatten()",
     "online_dpo: the judge's pick scored as the loser",
     [PASSES + "::test_online_dpo_pairs_take_the_judges_pick_and_the_higher_score_as_chosen"]),
    ("algos/grpo.py", "centered = centered / (torch.nan_to_num(rewards[~rewards.isnan()].std()) + 1e-4)",
     "centered = centered / (torch.nan_to_num(rewards.std()) + 1e-4)",
     "grpo: batch std with the unscored (NaN) rewards in it",
     ["tests/test_grpo.py::test_unscorable_completions_leave_their_group_hand_worked"]),
    ("algos/rloo.py", "baseline = (grouped.nansum(dim=1, keepdim=True) - grouped) / (n - 1).clamp(min=1)",
     "baseline = (grouped.nansum(dim=1, keepdim=True) - grouped) / n.clamp(min=1)",
     "rloo: leave-one-out mean divided by k instead of k - 1",
     ["tests/test_rloo.py::test_leave_one_out_baseline_matches_a_loop_over_prompts"]),
    ("algos/ppo.py", "next_advantage = delta + gamma * lam * next_advantage",
     "next_advantage = delta + lam * next_advantage",
     "ppo: GAE without the discount",
     ["tests/test_ppo.py::test_gae_hand_worked"]),
    ("algos/sft.py", "logprobs = token_logprobs(logits[:, :-1], input_ids[:, 1:])",
     "logprobs = token_logprobs(logits[:, 1:], input_ids[:, 1:])",
     "sft: labels not shifted against the logits",
     ["tests/test_sft.py::test_sft_loss_equals_cross_entropy_on_completion_tokens"]),
    ("algos/sft.py", "num_tokens = global_tokens / (args.gradient_accumulation_steps * args.world_size)",
     "num_tokens = global_tokens / args.world_size",
     "sft: loss not rescaled under gradient accumulation",
     ["tests/test_sft.py::test_gradient_accumulation_matches_one_big_batch"]),
    ("algos/reward.py", "loss = -F.logsigmoid(diff).mean()", "loss = -F.logsigmoid(-diff).mean()",
     "reward: chosen and rejected swapped in the loss",
     ["tests/test_reward.py::test_bradley_terry_loss_hand_computed"]),
    ("common/generation.py", "truncate_scores(logits[c].float() / temperature, keep=labels[c], **truncation)",
     "truncate_scores(logits[c].float(), keep=labels[c], **truncation)",
     "common: token_logprobs ignores the temperature",
     ["tests/test_common_generation.py::test_token_logprobs_match_softmax_with_temperature"]),
    ("common/generation.py", "return (attention_mask.cumsum(-1) - 1).clamp(min=0)",
     "return torch.arange(attention_mask.shape[-1]).expand_as(attention_mask)",
     "common: positions counted over the left padding",
     ["tests/test_common_generation.py::test_left_padded_rows_give_their_own_logprobs_on_a_model_with_absolute_positions"]),
    ("common/generation.py", "keep = torch.arange(ids.shape[1], device=ids.device)[None, :] <= first_stop[:, None]",
     "keep = torch.arange(ids.shape[1], device=ids.device)[None, :] < first_stop[:, None]",
     "common: the stop token (EOS) cut from the completion",
     ["tests/test_common_generation.py::test_truncate_at_first_stop_token"]),
    ("algos/grpo.py", "per_token = -torch.clamp(ratio, max=1 + epsilon_high).detach() * a * logps",
     "per_token = -torch.clamp(ratio, max=1 + epsilon_high) * a * logps",
     "grpo: cispo's importance weight without the stop-gradient",
     ["tests/test_grpo.py::test_cispo_hand_worked_value_and_gradient"]),
    ("algos/grpo.py", "per_token = -torch.clamp(ratio, max=1 + epsilon_high).detach() * a * logps",
     "per_token = -torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high).detach() * a * logps",
     "grpo: cispo's weight clipped from below too",
     ["tests/test_grpo.py::test_cispo_hand_worked_value_and_gradient"]),
    ("algos/grpo.py", "per_token = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * a",
     "per_token = -torch.sigmoid(tau * (1 - ratio)) * 4 / tau * a",
     "grpo: sapo's gate on the wrong side of ratio 1",
     ["tests/test_grpo.py::test_sapo_hand_worked_value_and_gradient"]),
    ("algos/grpo.py", "tau = torch.where(a > 0, sapo_temperature_pos, sapo_temperature_neg)",
     "tau = torch.where(a > 0, sapo_temperature_neg, sapo_temperature_pos)",
     "grpo: sapo's temperatures swapped (tau_pos for negative advantages)",
     ["tests/test_grpo.py::test_sapo_hand_worked_value_and_gradient"]),
    ("algos/grpo.py", ".clamp(min=-1, max=0) * factor", ".clamp(max=0) * factor",
     "grpo: overlong punishment not capped at -factor",
     ["tests/test_grpo.py::test_overlong_penalty_at_the_buffer_edges"]),
    ("algos/grpo.py", "torch.quantile(entropy[mask.bool()].float(), 1 - quantile)",
     "torch.quantile(entropy.flatten().float(), 1 - quantile)",
     "grpo: entropy quantile over the padding too",
     ["tests/test_grpo.py::test_top_entropy_mask_hand_worked"]),
    ("algos/grpo.py", "torch.cat([b[k][m] for m, b in zip(keep, pool)] + [b[k][~m] for m, b in zip(keep, pool)])",
     "torch.cat([b[k] for m, b in zip(keep, pool)])",
     "grpo: dynamic sampling keeps the constant groups",
     ["tests/test_grpo.py::test_dynamic_sampling_keeps_informative_groups_and_counts_its_rounds"]),
    ("algos/rloo.py",
     "per_token, clipped = -torch.clamp(ratio, max=1 + cliprange).detach() * a * logps, ratio > 1 + cliprange",
     "per_token, clipped = -torch.clamp(ratio, max=1 + cliprange) * a * logps, ratio > 1 + cliprange",
     "rloo: cispo's importance weight without the stop-gradient",
     ["tests/test_rloo.py::test_cispo_hand_worked_value_and_gradient"]),
    ("algos/rloo.py", "tau = torch.where(a > 0, sapo_temperature_pos, sapo_temperature_neg)",
     "tau = torch.where(a > 0, sapo_temperature_neg, sapo_temperature_pos)",
     "rloo: sapo's temperatures swapped (tau_pos for negative advantages)",
     ["tests/test_rloo.py::test_sapo_hand_worked_value_and_gradient"]),
    ("common/generation.py", "logps = token_logprobs(logits, input_ids[:, prompt_width:], temperature, **truncation)",
     "logps = token_logprobs(logits, input_ids[:, prompt_width:], temperature)",
     "common: completion log-probabilities over the whole vocabulary under top-k / top-p / min-p",
     [PASSES + "::test_completion_logps_under_truncation_equal_each_rows_own_forward[top_k]"]),
    ("algos/rloo.py", "args.temperature, entropy=True, **truncation)", "args.temperature, entropy=True)",
     "rloo: the training pass over the whole vocabulary under top-k / top-p / min-p",
     [ASYNC_STEP + "[rloo]"]),
    ("common/generation.py", "truncate_scores(logits[c].float() / temperature, keep=labels[c], **truncation)",
     "truncate_scores(logits[c].float() / temperature, **truncation)",
     "common: a label the truncation drops gets log-probability -inf",
     ["tests/test_common_generation.py::test_token_logprobs_of_the_truncated_distribution_hand_worked[top_k]"]),
    # the loops between the functions (issue 38): each script's first step at its defaults, gradient against the loss
    # written out in the test (tests/first_step.py)
    ("algos/grpo.py", "old = logps.detach() if r.old_logps is None", "old = logps if r.old_logps is None",
     "grpo: sampling-time logprobs not detached at num_iterations 1 (the policy gradient vanishes)", [GRPO_STEP]),
    ("algos/grpo.py", "loss_mask = c_mask.float() * ~rewards.isnan()[:, None]", "loss_mask = c_mask.float()",
     "grpo: unscored completions back in the loss (their KL term, their tokens in the count)", [GRPO_STEP]),
    ("algos/grpo.py", "ref_logps = rollout_logps(ref, input_ids",
     "ref_logps = rollout_logps(model, input_ids",
     "grpo: reference logprobs from the policy (the KL term vanishes)", [GRPO_STEP]),
    ("algos/ppo.py", "old_logps * mask, ref_logps * mask, old_values * mask",
     "old_logps * mask, ref_logps * mask, old_values",
     "ppo: values after the EOS not zeroed (they leak into GAE)", [PPO_STEP]),
    ("algos/ppo.py", "advantages = whiten(advantages, r.mask)",
     "advantages = whiten(advantages, torch.ones_like(r.mask))",
     "ppo: advantages whitened over the padding after the EOS too", [PPO_STEP]),
    ("algos/ppo.py", "loss = pg_loss + args.vf_coef * vf_loss", "loss = pg_loss",
     "ppo: value loss left out", [PPO_STEP]),
    ("algos/rloo.py", "advantages = whiten(advantages, all_mask)", "advantages = whiten(advantages)",
     "rloo: token-level advantages whitened over the padding too", [RLOO_STEP + "[token_level_kl_whitened]"]),
    ("algos/rloo.py", "advantages = whiten(advantages, all_mask)", "advantages = whiten(advantages, sampled)",
     "rloo: token-level advantages whitened over the unscored completions too",
     [RLOO_STEP + "[token_level_kl_whitened]"]),
    ("algos/rloo.py", "rlhf_reward = all_scores + non_score_reward", "rlhf_reward = all_scores",
     "rloo: KL penalty left out of the reward", [RLOO_STEP + "[default]"]),
    ("algos/dpo.py", "bco_sum, bco_count = bco_sum + total[0].item(), bco_count + int(total[1].item())",
     "bco_sum, bco_count = total[0].item(), int(total[1].item())",
     "dpo: bco_pair's delta from the last step only, not the running mean", [DPO_BCO]),
    ("algos/dpo.py", "2.0 * len(indices)", "1.0 * len(indices)",
     "dpo: bco_pair's running mean counts one reward per pair, not two", [DPO_BCO]),
    ("algos/dpo.py", "ref_c, ref_r = cached_ref[indices]", "ref_r, ref_c = cached_ref[indices]",
     "dpo: reference logprobs of chosen and rejected swapped", ["tests/test_dpo.py::" + STEP]),
    ("algos/kto.py", "labels = labels.to(accelerator.device)", "labels = ~labels.to(accelerator.device)",
     "kto: desirable and undesirable rows swapped in the step", ["tests/test_kto.py::" + STEP]),
    ("algos/online_dpo.py", "loss = (losses * ranked).sum() / len(losses)", "loss = losses.mean()",
     "online_dpo: pairs with an unscored completion trained", ["tests/test_online_dpo.py::" + STEP]),
    ("algos/sft.py", "loss = sft_loss(logits, input_ids, loss_mask, num_tokens=num_tokens)",
     "loss = sft_loss(logits, input_ids, attention_mask, num_tokens=num_tokens)",
     "sft: prompt tokens learnt (the attention mask as loss mask)",
     ["tests/test_sft.py::test_default_first_step_gradient_against_the_cross_entropy_written_out"]),
    ("algos/reward.py", "chosen, rejected = scores(model, ", "rejected, chosen = scores(model, ",
     "reward: chosen and rejected swapped where a batch is scored", ["tests/test_reward.py::" + STEP]),
    # multi-turn episodes (issue 40)
    ("common/episodes.py", "own[i] + [0] * len(glue)", "own[i] + [1] * len(glue)",
     "episodes: tool results and the template's glue trained as the model's tokens",
     ["tests/test_episodes.py::test_a_three_turn_episode_token_by_token"]),
    ("algos/grpo.py", "attention_mask = torch.cat([p_mask, batch.get(\"episode_mask\", c_mask)], 1)",
     "attention_mask = torch.cat([p_mask, c_mask], 1)", "grpo: tool results hidden from the policy's forward",
     ["tests/test_episodes.py::test_grpo_first_step_trains_the_models_tokens_of_each_episode_only[padded]"]),
    ("algos/rloo.py", "episodes.samples, episodes.columns, episodes.samples.model_mask",
     "episodes.samples, episodes.columns, episodes.samples.completion_mask",
     "rloo: tool results in the loss, the KL penalty and the token count",
     ["tests/test_episodes.py::test_rloo_first_step_trains_the_models_tokens_of_each_episode_only"]),
    # asynchronous rollouts (issue 41)
    ("common/rollouts.py", "policy is not None and version != self.copy_version:",
     "policy is not None and self.copy_version is None:",
     "async: the sampler's copy takes the first weights only, never the newer ones", [ASYNC_VERSIONS]),
    ("algos/grpo.py", "stale = torch.exp(old - r.sampler_logps[s]) * mask",
     "stale = torch.exp(r.sampler_logps[s] - old) * mask",
     "grpo: the staleness weight inverted (pi_behaviour / pi_old)", [ASYNC_VERSIONS]),
    ("common/rollouts.py", "if version - drawn_by <= self.k:", "if version - drawn_by <= self.k + 1:",
     "async: a batch one version too old kept", [ASYNC_DROP]),
    # on-policy distillation (issue 43)
    ("algos/gkd.py", "return (p.exp() * (p - q)).sum(-1)  # KL(P || Q)", "return (q.exp() * (q - p)).sum(-1)",
     "gkd: beta 0 takes the reverse KL", ["tests/test_gkd.py::test_divergence_against_its_definition"]),
    ("algos/gkd.py", "return (per_token * mask).sum() / num_tokens, per_token.detach()",
     "return (per_token * mask).sum() / mask.sum(), per_token.detach()",
     "gkd: the loss averaged per micro-batch, not over the step's tokens",
     ["tests/test_gkd.py::test_loss_sums_the_masked_tokens_over_the_step_token_count"]),
    ("algos/gkd.py", "return shifted_logits(model, input_ids, attention_mask, prompt_ids.shape[1] - 1)",
     "return shifted_logits(model, input_ids, attention_mask, prompt_ids.shape[1])",
     "gkd: the logits read one position late", ["tests/test_gkd.py::test_completion_logits_are_each_rows_own"]),
    ("algos/gkd.py", "g, probs = (q - log_m) / beta, q.exp()", "g, probs = q - log_m, q.exp()",
     "gkd: the gradient without its 1 / beta", ["tests/test_gkd.py::test_divergence_gradient"]),
    ("algos/gkd.py", "student_logits = completion_logits(model, p_ids, p_mask, c_ids, c_mask)",
     "student_logits = completion_logits(model, p_ids, p_mask, c_ids, c_mask) / args.temperature",
     "gkd: the student's logits at the sampling temperature",
     ["tests/test_gkd.py::test_the_divergence_gets_the_models_own_logits_whatever_the_sampling_temperature"]),
    # the multi-turn, vLLM and checkpoint paths (issue 55)
    ("algos/rloo.py", "last = (mask.bool() * torch.arange(1, mask.shape[1] + 1, device=mask.device)).argmax(dim=1)",
     "last = (mask.sum(dim=1) - 1).clamp(min=0).long()",
     "rloo: token-level score at the count of trained tokens (inside a tool result when the mask has gaps)",
     ["tests/test_rloo.py::test_token_level_advantages_score_the_last_trained_token_across_tool_gaps"]),
    ("common/episodes.py", "budget = max(max_new_tokens - len(ids[i]) for i in active) if active else 1",
     "budget = min(max_new_tokens - len(ids[i]) for i in active) if active else 1",
     "episodes: a shared turn sampled with the smallest room left, not the largest", [EPISODES_ROOM]),
    ("common/episodes.py", "new = out.completion_ids[row, :length].tolist()[:max_new_tokens - len(ids[i])]",
     "new = out.completion_ids[row, :length].tolist()",
     "episodes: a reply not cut at its own episode's room", [EPISODES_ROOM]),
    ("common/episodes.py", "stopped = bool(out.finished[row]) and len(new) == length",
     "stopped = bool(out.finished[row])", "episodes: a reply cut at its room counted as finished", [EPISODES_ROOM]),
    ("common/episodes.py", "return full[at + len(end):]", "return full[at:]",
     "episodes: the turn's end token written twice before the tool results", [EPISODES_FAMILIES]),
    ("common/episodes.py", "if REPLY not in alone or REPLY not in full or not full.startswith(end, at):",
     "if REPLY not in alone or REPLY not in full:",
     "episodes: a template ending turns differently before tool results accepted",
     ["tests/test_episodes.py::test_a_template_that_ends_a_turn_differently_before_tool_results_is_refused_at_start_up"]),
    ("common/episodes.py", "            worker.join(timeout)\n", "            worker.join()\n",
     "episodes: --tool_timeout not applied (a hung tool hangs the rollout)", [EPISODES_TOOL_LIMITS]),
    ("common/episodes.py", 'if any(len(m["content"]) > most for m, _ in answers):', "if False:",
     "episodes: a huge tool result tokenised whole", [EPISODES_TOOL_LIMITS]),
    ("common/episodes.py", 'text, failed = str({"error": str(e)}), True',
     'text, failed = str({"error": str(e)}), False',
     "episodes: failed and timed-out calls not counted as failures", [EPISODES_TOOL_LIMITS]),
    ("common/resume.py", "if name in DCP_METADATA_CLASSES.get(module, ()) or (", "if True or (",
     "resume: the DCP metadata unpickler admits every global", [DCP_REFUSED]),
    ("common/resume.py", "isinstance(getattr(torch, name, None), torch.dtype)",
     "getattr(torch, name, None) is not None",
     "resume: any torch.<name> admitted in DCP metadata, not only dtypes", [DCP_REFUSED]),
    ("common/resume.py", "verdicts = gather_object([(os.path.isfile(rank_file), unsafe_metadata(path))])",
     "verdicts = [(os.path.isfile(rank_file), unsafe_metadata(path))]",
     "resume: each rank judges only its own copy of the metadata; the others go on loading",
     ["tests/test_common_checkpoint.py::test_dcp_metadata_that_would_run_code_on_one_machine_stops_every_rank"]),
    ("common/checkpoint.py", 'return sorted((d for d in names if d.startswith("step_")), key=lambda d: int(d[5:]))',
     'return sorted(d for d in names if d.startswith("step_"))',
     "checkpoints ordered by name (step_10 before step_9) when pruned", [STEPS_PAST_9]),
    ("common/resume.py", "max(everywhere, key=lambda d: int(d[5:]))", "max(everywhere)",
     "resume latest: the largest name (step_9 over step_11)", [STEPS_PAST_9]),
    ("common/checkpoint.py", "self.saved()[:-max(1, self.save_total_limit)]",
     "self.saved()[max(1, self.save_total_limit):]",
     "checkpoints: pruning deletes the newest beyond the limit", [STEPS_PAST_9]),
    ("common/vllm.py", "[self.vllm.SamplingParams(seed=s, **o) for _, ss, o in group for s in ss]",
     "[self.vllm.SamplingParams(seed=s, **params) for _, ss, o in group for s in ss]",
     "vLLM tensor parallel: every prompt asked with this rank's options (ranks ask the engine different requests)",
     [VLLM + "test_a_tensor_parallel_group_asks_its_engine_the_same_requests_on_every_turn"]),
    ("common/vllm.py", "                mine = slice(start, start + len(prompts))\n",
     "                mine = slice(0, len(prompts))\n",
     "vLLM tensor parallel: every rank takes the first rank's completions",
     [VLLM + "test_a_tensor_parallel_group_asks_its_engine_the_same_requests_on_every_turn"]),
    ("common/vllm.py", "        self.needs_push = False  # both modes",
     "        self.needs_push = self.mode == 'server'",
     "vLLM server: needs_push never cleared, the weights pushed before every turn and round",
     [VLLM + "test_server_mode_pushes_once_per_rollout_of_several_turns",
      VLLM + "test_grpo_dynamic_sampling_pushes_to_the_server_once_per_rollout"]),
    ("common/vllm.py", 'if (mode := server_logprobs_mode(url)) != "processed_logprobs":',
     'if (mode := server_logprobs_mode(url)) not in ("processed_logprobs", None):',
     "vLLM server: one that does not report its logprobs mode accepted",
     [VLLM + "test_a_server_without_processed_logprobs_is_refused_before_any_model_loads"]),
    ("common/vllm.py", '["vllm_config"]["model_config"]["logprobs_mode"]', '["vllm_config"]["logprobs_mode"]',
     "vLLM server: the logprobs mode read at the wrong level of /server_info",
     [VLLM + "test_a_server_with_processed_logprobs_is_accepted"]),
    ("common/vllm.py", 'logprobs_mode="processed_logprobs"', 'logprobs_mode="raw_logprobs"',
     "vLLM colocated: the engine built with vLLM's default raw log-probabilities",
     [VLLM + "test_engine_options_reach_vllm_and_bad_tensor_parallel_sizes_are_refused"]),
    ("common/vllm.py",
     "            self.llm.reset_prefix_cache()  # cached prompt states came from the old weights\n", "",
     "vLLM colocated: no prefix-cache reset after a push (prompts' states from the old weights)",
     [VLLM + "test_engine_options_reach_vllm_and_bad_tensor_parallel_sizes_are_refused"]),
    ("algos/gkd.py", "return torch.float64 if 0 < min(beta, 1 - beta) < 0.05 else torch.promote_types(",
     "return torch.float32 if 0 < min(beta, 1 - beta) < 0.05 else torch.promote_types(",
     "gkd: no float64 near beta 0 or 1",
     [GKD + "test_float32_logits_near_the_ends_give_the_float64_values"]),
    ("algos/gkd.py", "0 < min(beta, 1 - beta) < 0.05", "0 <= min(beta, 1 - beta) < 0.05",
     "gkd: beta 0 and 1 moved to float64 (the main job's numbers move)",
     [GKD + "test_beta_0_1_and_the_middle_keep_their_fp32_values"]),
    ("algos/gkd.py", "torch.logaddexp(p + math.log(beta), q + math.log(1 - beta))",
     "torch.logaddexp(p + math.log(1 - beta), q + math.log(beta))",
     "gkd: the backward's log M with beta and 1 - beta swapped", [GKD_BACKWARD]),
    ("algos/gkd.py", "out[i:i + size, :vocab] = d * grad[i:i + size, None]", "out[i:i + size, :vocab] = d",
     "gkd: the backward drops the incoming gradient", [GKD_BACKWARD]),
    ("algos/gkd.py", "sampled = [on_policy(args.seed, place, args.lmbda) for _, place in batch]",
     "sampled = [on_policy(args.seed, place, 1 - args.lmbda) for _, place in batch]",
     "gkd: a share 1 - lmbda of the prompts sampled", [GKD_DRAW]),
    ("algos/gkd.py", "place += per_step", "place += args.per_device_train_batch_size",
     "gkd: a prompt's place in the run counted per rank", [GKD_DRAW]),
    ("algos/gkd.py", "ids[place] = c[m.bool()].tolist()", "ids[i] = c[m.bool()].tolist()",
     "gkd: on-policy rows trained on the dataset's completion", [GKD_DRAW]),
    ("algos/grpo.py", "logps_options = dict(temperature=args.temperature, **args.sampling.truncation())",
     "logps_options = dict(temperature=args.temperature)",
     "grpo: the log-probs (the behaviour policy's too) without the top_k / top_p / min_p truncation",
     [ASYNC_LOGPS + "[grpo]", ASYNC_STEP + "[grpo]"]),
    ("algos/grpo.py", "logps_options = dict(temperature=args.temperature, **args.sampling.truncation())",
     "logps_options = dict(temperature=1.0, **args.sampling.truncation())",
     "grpo: the log-probs (the behaviour policy's too) at temperature 1",
     [ASYNC_LOGPS + "[grpo]", ASYNC_STEP + "[grpo]"]),
    ("common/rollouts.py", "torch.cat([s.prompt_mask, s.completion_mask], 1)",
     "torch.cat([s.prompt_mask, s.model_mask], 1)",
     "async: the behaviour pass does not attend to tool results", [ASYNC_LOGPS + "[grpo]", ASYNC_LOGPS + "[rloo]"]),
    ("algos/grpo.py", "stale = torch.exp(old - r.sampler_logps[s]) * mask",
     "stale = torch.exp(logps - r.sampler_logps[s]) * mask",
     "grpo: the staleness weight from the live log-probs (it carries a gradient)", [ASYNC_STEP + "[grpo]"]),
    ("algos/grpo.py", "is_weights = is_weights * stale.clamp(max=args.rollouts.async_importance_sampling_cap)",
     "is_weights = is_weights * stale.clamp(max=2.0)", "grpo: --async_importance_sampling_cap ignored",
     [ASYNC_STEP + "[grpo]"]),
    ("algos/rloo.py", "stale = torch.exp(old_logps - sampler_logps) * sampled",
     "stale = torch.exp(sampler_logps - old_logps) * sampled", "rloo: the staleness weight inverted",
     [ASYNC_STEP + "[rloo]"]),
    ("algos/rloo.py", "is_weights = stale.clamp(max=args.rollouts.async_importance_sampling_cap)", "is_weights = stale",
     "rloo: the staleness weight not capped", [ASYNC_STEP + "[rloo]"]),
    ("algos/rloo.py", "m, old = all_mask[idx], old_logps[idx]", "m, old = all_mask[idx], sampler_logps[idx]",
     "rloo at K = 1: the ratio clipped against pi_behaviour, not pi_old", [ASYNC_STEP + "[rloo]"]),
    ("common/rollouts.py", 'super().__init__(name="sampler", daemon=True)', 'super().__init__(name="sampler")',
     "async: a failed run waits for the sampler's thread (for ever with a hung tool)",
     ["tests/test_async.py::test_a_failed_run_at_k_1_ends_without_waiting_for_the_sampler_thread"]),
    ("common/runtime.py", """rank = f"[rank {os.environ['RANK']}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1""",
     """rank = f"[rank {os.environ['RANK']}] " if int(os.environ.get("WORLD_SIZE", "1")) > 2""",
     "error lines: no [rank N] prefix on 2 processes",
     [EPISODES + "test_an_error_line_carries_the_rank_when_there_are_several_processes"]),
    ("common/generation.py", "torch.distributed.ReduceOp.MAX", "torch.distributed.ReduceOp.MIN",
     "sharded decoding: ranks agree on the fewest chunks (out of step past 64 prompts)",
     ["tests/test_sharded_generate.py::test_fsdp2_ranks_with_more_chunks_than_others_decode_in_step"]),
    ("common/runtime.py", 'sys.stderr.write(f"{rank}error: {e}\\n")', 'print(f"{rank}error: {e}", file=sys.stderr)',
     "error lines: the message and its newline in two writes (two ranks' lines can share one)",
     [EPISODES + "test_an_error_line_carries_the_rank_when_there_are_several_processes"]),
    ("algos/grpo.py", "    if sampler or tools or args.rollouts.max_staleness:", "    if True:",
     "grpo: a base run goes through the features' rollout stream",
     ["tests/test_base_path.py::test_a_base_run_calls_no_function_of_a_feature_module[grpo]"]),
    ("algos/grpo.py", "    if args.vllm.use_vllm or args.rollouts.max_staleness:", "    if True:",
     "grpo: a base run calls the asynchronous rollouts' checks",
     ["tests/test_base_path.py::test_a_base_run_calls_no_function_of_a_feature_module[grpo]"]),
    ("common/generation.py", "@torch.no_grad()\ndef token_entropy_no_grad", "def token_entropy_no_grad",
     "token_entropy_no_grad keeps a graph (its name says it has none)",
     ["tests/test_common_generation.py::test_chunked_logprobs_and_entropy_equal_the_whole_tensor_formula"]),
    ("algos/sft.py", "chunk = batch[m * per_step:(m + 1) * per_step]", "chunk = batch[:per_step]",
     "sft: every accumulated micro-batch repeats the step's first one",
     ["tests/test_sft.py::test_gradient_accumulation_matches_one_big_batch"]),
    ("algos/gkd.py", "yield batch[rank::world_size]", "yield batch[rank:][:len(batch) // world_size]",
     "gkd: each rank takes a contiguous block, not every world_size-th",
     ["tests/test_gkd.py::test_on_and_off_policy_prompts_follow_the_global_draw"]),
    ("algos/gkd.py", "batch = [(i, place + j) for j, i in", "batch = [(i, place) for j, i in",
     "gkd: every prompt of a batch gets the batch's first place",
     ["tests/test_gkd.py::test_on_and_off_policy_prompts_follow_the_global_draw"]),
    ("algos/gkd.py", "[:max_new_tokens]\n", "\n", "gkd: the dataset's completion not cut to max_new_tokens",
     ["tests/test_gkd.py::test_a_micro_batch_pads_prompts_left_completions_right_and_cuts_only_the_datasets"]),
    ("algos/gkd.py", "and c[-1] == tokenizer.eos_token_id", "and c[-1] != tokenizer.pad_token_id",
     "gkd: finished is 'does not end in pad'",
     ["tests/test_gkd.py::test_a_micro_batch_pads_prompts_left_completions_right_and_cuts_only_the_datasets"]),
    ("algos/online_dpo.py", "for start in range(0, num_rows - per_step + 1, per_step):",
     "for start in range(0, num_rows - per_step, per_step):", "online_dpo: a pass drops its last full batch",
     [ONLINE_DPO_BATCHES]),
    ("algos/online_dpo.py", "yield order[start:start + per_step][rank::world_size]",
     "yield order[start:start + per_step][rank * world_size:]", "online_dpo: rank's share is a tail",
     [ONLINE_DPO_BATCHES]),
    ("algos/rloo.py", "seeds = [args.seed * 10**9 + episode + rank * local_size + j for j in range(local_size)]",
     "seeds = [args.seed * 10**9 + rank * local_size + j for j in range(local_size)]",
     "rloo: every rollout sampled with the same seeds", [RLOO_BASE]),
    ("algos/rloo.py", "else as_completions(prompts, texts)", "else texts",
     "rloo: conversational completions given to reward functions as strings", [RLOO_BASE]),
    ("algos/rloo.py", 'columns = {k: [rows[i][k] for i in indices] for k in rows[0] if k != "prompt"} | columns',
     "columns = dict(columns)", "rloo: the data's other columns not passed to reward functions", [RLOO_BASE]),
    ("algos/rloo.py", "if sampler or tools or args.rollouts.max_staleness:", "if sampler or tools:",
     "rloo: --max_staleness alone ignored (sampled in turn)",
     ["tests/test_rloo.py::test_max_staleness_alone_draws_each_rollout_ahead"]),
    ("algos/rloo.py", "completions = episodes.completions if tools else as_completions(prompts, texts)",
     "completions = as_completions(prompts, texts)",
     "rloo: multi-turn episodes scored as their text only", [ASYNC_STEP + "[rloo]"]),
    ("algos/rloo.py", "if corrected:  #", "if False:  #", "rloo: the vLLM sampler correction never applied",
     ["tests/test_common_vllm.py::test_truncated_sampling_leaves_the_sampler_ratio_at_one[rloo-top_k]"]),
    # 115-: the last of issue 56 (grpo's loss statistics, the rollout's metrics, the shared helpers)
    ("algos/grpo.py", "(ratio > 1 + epsilon_high) & (a > 0)  # exclusive",
     "(ratio > 1 + epsilon) & (a > 0)  # exclusive",
     "grpo: clip_ratio/high_mean counted against epsilon, not epsilon_high", [GRPO_STATS + "[token]"]),
    ("algos/grpo.py", "(ratio < 1 - epsilon) & (a < 0), ", "(ratio < 1 - epsilon) & (a > 0), ",
     "grpo: clip_ratio/low_mean counted for positive advantages", [GRPO_STATS + "[token]"]),
    ("algos/grpo.py", 'stats["kl"] = (kl.detach() * mask).sum() / tokens', 'stats["kl"] = (kl * mask).sum() / tokens',
     "grpo: the kl statistic keeps the graph of every micro-batch", [GRPO_STATS + "[token]"]),
    ("algos/grpo.py", 'tokens = accelerator.reduce(r.loss_mask.sum(), "sum")',
     'tokens = accelerator.reduce(r.completion_mask.sum(), "sum")',
     "grpo: dapo's normaliser counts the tokens of unscorable completions", [GRPO_STEP]),
    ("algos/grpo.py", '"completions/clipped_ratio": 1 - accelerator.gather(finished.float()).mean().item()',
     '"completions/clipped_ratio": accelerator.gather(finished.float()).mean().item()',
     "grpo: completions/clipped_ratio counts the completions that stopped",
     ["tests/test_grpo.py::test_missing_eos_penalty_and_reward_metrics"]),
    ("common/runtime.py", '    check_output_dir(values["output_dir"], values["overwrite_output_dir"], '
     'values["resume_from_checkpoint"])', "    pass", "common: a finished run's output_dir overwritten unasked",
     ["tests/test_common_checkpoint.py::test_output_dir_of_a_finished_or_unfinished_run_is_not_reused_by_accident"]),
    ("common/data.py", '[-max_tokens:] for row in rows]', '[:max_tokens] for row in rows]',
     "common: a long prompt cut at its end (its question lost), not its start",
     ["tests/test_common_data.py::test_load_prompts_keeps_each_prompts_end_and_refuses_too_few_for_a_batch"]),
    ("common/data.py", "if is_conversational(p) else t for p, t in zip(prompts, texts)]",
     "if is_conversational(t) else t for p, t in zip(prompts, texts)]",
     "common: a conversation's completion given to reward functions as text",
     ["tests/test_common_data.py::test_completions_are_messages_after_a_conversation_and_text_after_text"]),
    # 123-: padding-free passes (issue 57, common/packing.py)
    ("common/packing.py", "positions[place[real]] = offsets[real]", "positions[place[real]] = place[real]",
     "packing: position ids run on across the packed row instead of restarting per row",
     [PACKED + "test_each_completion_layout_gives_the_padded_logps_entropy_and_gradient[rows-one-row-sdpa]"]),
    ("common/packing.py", "logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits",
     "logits = model(input_ids=ids, position_ids=positions, use_cache=True).logits",
     "packing: a cache left on (transformers then lets every row attend to the rows before it)",
     [PACKED + "test_an_sft_step_padding_free_gives_the_padded_steps_loss_and_gradient[text]"]),
    ("common/packing.py", "mask[None] * (positions.view(1, -1) > 0), rows", "mask[None], rows",
     "packing: a text row's first token in the loss (predicted by the row before it)",
     [PACKED + "test_an_sft_step_padding_free_gives_the_padded_steps_loss_and_gradient[text]"]),
    ("common/packing.py", "token_logprobs(logits[:, :-1], ids[:, 1:])[0] * mask",
     "token_logprobs(logits[:, :-1], ids[:, :-1])[0] * mask",
     "packing: dpo's per-row sums read each label a token early",
     [PACKED + "test_dpo_pairs_padding_free_give_the_padded_logps_counts_mean_logits_and_gradient[sdpa-bins]"]),
    ("common/packing.py", "outputs[0].flatten(0, 1)[place.max(-1).values, 0]",
     "outputs[0].flatten(0, 1)[place.max(-1).values - 1, 0]",
     "packing: a reward model's score read at the token before each row's last",
     [PACKED + "test_packed_scores_and_their_gradient_equal_the_padded_scores"]),
    ("common/packing.py", ".last_hidden_state.flatten(0, 1)[before]", ".last_hidden_state.flatten(0, 1)[before + 1]",
     "packing: ppo's values read at the state after each response token, not before it",
     [PACKED + "test_ppo_policy_and_value_pass_packed_equals_the_padded_pass"]),
    ("common/packing.py", "device=device))[5:]", "device=device))[4:-1]",
     "packing: the start-up check compares the packed row's wrong tokens with the row alone",
     [PACKED + "test_packing_check_passes_attention_models_whose_rows_stay_apart[llama-sdpa]"]),
    ("algos/reward.py", "rewards_of(model, batch, accelerator.device, args.packing.padding_free)\n        sums",
     "rewards_of(model, batch, accelerator.device)\n        sums", "reward: --padding_free left out of evaluation",
     [PACKED + "test_reward_evaluation_padding_free_reads_packed_scores_equal_to_the_padded_ones"]),
    # 131-: a script that scores with the padded pass under --padding_free (the same values: only a count sees it)
    ("algos/grpo.py", "((packed_completion_logps, packed_scores) if",
     "((packed_completion_logps, last_token_scores) if",
     "grpo: the reward model scored padded under --padding_free",
     [PACKED + "test_grpo_steps_padding_free_give_the_padded_steps_values"]),
    ("algos/rloo.py", "((packed_completion_logps, packed_scores) if",
     "((packed_completion_logps, last_token_scores) if",
     "rloo: the reward model scored padded under --padding_free",
     [PACKED + "test_an_rloo_step_padding_free_gives_the_padded_steps_values"]),
    ("algos/online_dpo.py", "scores=packed_scores if args.packing.padding_free",
     "scores=last_token_scores if args.packing.padding_free",
     "online_dpo: the reward model scored padded under --padding_free",
     [PACKED + "test_an_online_dpo_step_padding_free_gives_the_padded_steps_values"]),
    ("algos/ppo.py", "scores=packed_scores if args.packing.padding_free else last_token_scores)",
     "scores=last_token_scores)",
     "ppo: the reward model scored padded under --padding_free",
     [PACKED + "test_a_ppo_step_padding_free_gives_the_padded_steps_values"]),
    # 135-: packed rows of bounded length (bins)
    ("common/packing.py", "starts[i], fill[k] = k * width + fill[k],", "starts[i], fill[k] = fill[k],",
     "packing: a row's place in its bin without the bin's offset (rows of later bins written over the first's)",
     [PACKED + "test_pack_into_bins_goes_first_fit_longest_first_and_restarts_the_room_left",
      PACKED + "test_dpo_pairs_padding_free_give_the_padded_logps_counts_mean_logits_and_gradient[sdpa-bins]"]),
    ("common/packing.py", "    rows[flat] = torch.arange(", "    rows[:len(flat)] = torch.arange(",
     "packing: each packed token's row read in the rows' order, not in the order the bins hold them",
     [PACKED + "test_dpo_pairs_padding_free_give_the_padded_logps_counts_mean_logits_and_gradient[sdpa-bins]"]),
    ("common/packing.py", "_cost(macs, lengths, max(lengths)) < _cost(", "_cost(macs, lengths, max(lengths)) > _cost(",
     "packing: the dearer layout taken (bins where one packed row costs less, and the other way round)",
     [PACKED + "test_bin_length_takes_the_cheaper_layout_and_flash_gets_one_packed_row[sdpa]"]),
    ("common/packing.py", "* width * (macs[0] + width * macs[1])", "* width * macs[0]",
     "packing: the bins' attention left out of their cost",
     [PACKED + "test_bin_length_takes_the_cheaper_layout_and_flash_gets_one_packed_row[sdpa]"]),
    ("benchmarks/padding_free.py", "*NO_EVAL[script],\n            *shlex.split(args.extra)]", "*NO_EVAL[script]]",
     "padding_free benchmark: --extra dropped (a GPU run would measure the CPU's batch sizes)",
     ["tests/test_padding_free_benchmark.py::"
      "test_extra_flags_come_after_the_shapes_and_the_packed_run_alone_is_padding_free"]),
    # 140-: the completion passes' shared prompts (each prompt once, its completions after it, a mask of ours)
    ("common/packing.py", "(branch[:, None, :] == branch[:, :, None])", "(branch[:, None, :] >= 0)",
     "packing: a shared prompt's completion attends to the completions packed before it",
     [PACKED + "test_a_completion_sees_its_prompt_and_not_the_completions_beside_it[sdpa]",
      PACKED + "test_each_completion_layout_gives_the_padded_logps_entropy_and_gradient[shared-one-row-sdpa]"]),
    ("common/packing.py", "(p[:, None] + offsets)[real]", "offsets[real]",
     "packing: a completion's position ids restart at 0 instead of running on from its prompt's",
     [PACKED + "test_each_completion_layout_gives_the_padded_logps_entropy_and_gradient[shared-bins-sdpa]"]),
    ("common/packing.py", "(starts[group] + p - 1)[:, None], place - 1)", "place - 1, place - 1)",
     "packing: a completion's first token read after the completion packed before it, not after its prompt",
     [PACKED + "test_each_completion_layout_gives_the_padded_logps_entropy_and_gradient[shared-bins-sdpa]"]),
    ("common/packing.py", "(before_mine.cumsum(0) - before_mine)[rows, group]", "before_mine.cumsum(0)[rows, group]",
     "packing: a completion placed after its own length as well as its earlier siblings'",
     [PACKED + "test_each_completion_layout_gives_the_padded_logps_entropy_and_gradient[shared-one-row-sdpa]"]),
    ("common/packing.py", "    sees &= torch.ones(width, width, dtype=torch.bool, device=device).tril()\n", "",
     "packing: the shared layout's mask not causal",
     [PACKED + "test_each_completion_layout_gives_the_padded_logps_entropy_and_gradient[shared-bins-sdpa]"]),
    ("common/packing.py", ".masked_fill_(~sees,", ".masked_fill_(sees,",
     "packing: eager's 4D mask shuts out the positions to attend to, not the others",
     [PACKED + "test_each_completion_layout_gives_the_padded_logps_entropy_and_gradient[shared-bins-eager]"]),
    ("common/packing.py", "_, kind, width = min(options,", "_, kind, width = max(options,",
     "packing: the completion pass takes its dearest layout",
     [PACKED + "test_the_completion_layout_is_the_cheapest_by_the_count"]),
    ("common/packing.py", "for w in (max(shared), sum(shared)) if w <= window]", "for w in (max(shared), sum(shared))]",
     "packing: prompts shared beyond a sliding window, or by a model that ignores a 4D mask",
     [PACKED + "test_the_completion_layout_is_the_cheapest_by_the_count"]),
    ("common/packing.py", "(shared - alone).abs().max() <= tolerance", "(shared - alone).abs().max() > tolerance",
     "packing: the start-up check's note on a 4D mask the wrong way round",
     [PACKED + "test_the_packing_check_notes_a_model_that_ignores_a_4d_mask"]),
    # 149-: gkd's episodes (--environment_factory): the student's own tokens graded, tool results context
    ("algos/gkd.py", "ids, mask = c_ids, graded.float()", "ids, mask = c_ids, c_mask.float()",
     "gkd: an episode's tool results graded as the student's own tokens",
     [EPISODES + "test_gkd_first_step_distils_the_students_tokens_of_each_episode_only[padded]"]),
    ("algos/gkd.py", "sum(m.sum() for _, (_, _, _, _, m, _, _) in micro)",
     "sum(m.sum() for _, (_, _, _, m, _, _, _) in micro)",
     "gkd: the step's token count with an episode's tool results in it",
     [EPISODES + "test_gkd_first_step_distils_the_students_tokens_of_each_episode_only[padded]"]),
    ("algos/gkd.py", "mask = graded[c_mask.bool()][None].float()", "mask = c_mask[c_mask.bool()][None].float()",
     "gkd: packed, an episode's tool results graded",
     [EPISODES + "test_gkd_first_step_distils_the_students_tokens_of_each_episode_only[padding_free]"]),
    # 152-: several environments (--environment_factory name=module:Class ...)
    ("common/episodes.py", "(self.schemas[type(self.environments[i])] if self.environments else [])",
     "(sum(list(self.schemas.values())[1:], []) if self.environments else [])",
     "episodes: every environment's tools rendered in every episode's prompt",
     SEVERAL),
    ("common/episodes.py", "[resolved(e.get_reward()) if type(e) is _cls", "[resolved(e.get_reward()) if True",
     "episodes: an environment class's reward read from the other environments' episodes too",
     SEVERAL),
    ("common/episodes.py", 'if k != "environment"} if None not in tools.factories else row',
     "if True} if None not in tools.factories else row",
     "episodes: reset gets the row's `environment` field",
     SEVERAL),
    ("common/episodes.py", "pool, taken[name] = self.pools.setdefault(name, []), taken.get(name, -1) + 1",
     "pool, taken[name] = self.pools.setdefault(name, []), 0",
     "episodes: every episode of an environment in a batch given its pool's first instance",
     SEVERAL),
    # 156-: TRL's reward-function contract (issue 58 items 1, 3, 4)
    ("algos/grpo.py", "for c, m in zip(c_ids, samples.completion_mask)]", "for c, m in zip(c_ids, c_mask)]",
     "grpo: completion_ids to reward functions without an episode's tool results (not TRL's)",
     [EPISODES + "test_grpo_first_step_trains_the_models_tokens_of_each_episode_only[padded]"]),
    ("algos/rloo.py", "for ids, m in zip(c_ids, samples.completion_mask)]", "for ids, m in zip(c_ids, c_mask)]",
     "rloo: completion_ids to reward functions without an episode's tool results (not TRL's)",
     [EPISODES + "test_rloo_first_step_trains_the_models_tokens_of_each_episode_only"]),
    ("common/reward_extras.py", "p.name == name or p.kind is p.VAR_KEYWORD", "p.name == name",
     "reward extras: a function taking **kwargs (TRL's advice) not given them",
     [EXTRAS_STATE]),
    ("common/reward_extras.py", "        self.metrics.clear()\n", "",
     "reward extras: log_metric's values never cleared, each step's mean over the run so far",
     [EXTRAS_STATE]),
    ("common/reward_extras.py", "gathered.nanmean(0)", "gathered.mean(0)",
     "reward extras: a metric one process did not log averaged as NaN",
     [EXTRAS + "test_two_processes_average_log_metric_over_the_names_either_logged"]),
    ("common/reward_extras.py", "epoch=taken / self.epoch_size", "epoch=taken / self.max_steps",
     "reward extras: trainer_state.epoch counted in steps",
     [EXTRAS_STATE]),
    ("common/reward_extras.py", "        self.columns = {}\n        state", "        state",
     "reward extras: log_extra's columns of an earlier batch shown with this one's",
     [EXTRAS_STATE]),
    ("common/reward_extras.py", "return await asyncio.gather(*calls, return_exceptions=True)",
     "return [await c for c in calls]",
     "reward extras: async functions awaited one after the other",
     [EXTRAS + "test_async_functions_are_awaited_together_and_one_that_raises_is_one_line"]),
    ("algos/grpo.py", "call=extras and extras.caller(step, episode),",
     "call=extras and extras.caller(step + 1, episode),",
     "grpo: trainer_state.global_step one ahead",
     [EXTRAS + "test_the_script_passes_the_extras_logs_the_metric_and_shows_the_column[grpo]"]),
    ("algos/rloo.py", "metrics |= extras.flush() if extras else {}", "metrics |= {}",
     "rloo: log_metric's values never logged",
     [EXTRAS + "test_the_script_passes_the_extras_logs_the_metric_and_shows_the_column[rloo]"]),
    ("algos/grpo.py", "sources, weights, prompts=prompts, completions=completions,",
     'sources, weights, prompts=[rows[i]["prompt"] for i in indices], completions=completions,',
     "grpo: reward functions given the dataset's prompts, not the episodes' (reset()'s string left out)",
     [NO_DATASET + "[grpo]"]),
    ("common/episodes.py", "if tools.environments else {}, prompts)",
     "if tools.environments else {}, [without_nulls(r['prompt']) for r in rows])",
     "episodes: the episodes' prompts as the rows hold them, reset()'s string left out",
     [NO_DATASET + "[rloo]"]),
    ("common/runtime.py", 'if values.get("dataset_name") == "" and', 'if values.get("dataset_name") is None and',
     "runtime: no dataset and no environment accepted (empty prompts trained on)",
     [EPISODES + "test_no_dataset_needs_an_environment"]),
    ("algos/grpo.py", "len(rows) // n_prompts * args.generation_batch_size)", "len(rows) * args.num_generations)",
     "grpo: trainer_state.epoch counts the prompts a pass leaves out (its last, incomplete batch)",
     [EXTRAS + "test_the_script_passes_the_extras_logs_the_metric_and_shows_the_column[grpo]"]),
    ("common/reward_extras.py", "awaited, {}, self.timeout,", "asyncio.run, {}, self.timeout,",
     "reward extras: a new event loop for every batch (a client kept between calls is on a closed loop)",
     [EXTRAS + "test_async_functions_are_awaited_together_and_one_that_raises_is_one_line"]),
    ("common/reward_extras.py", 'table and not getattr(args, "dynamic_sampling", False)', "table",
     "reward extras: log_extra's columns shown beside the rows dynamic sampling reordered",
     [EXTRAS + "test_the_script_passes_the_extras_logs_the_metric_and_shows_the_column[grpo_dynamic]"]),
    ("common/episodes.py", "type(env) for pool in pools.values() for env in pool)",
     "type(pool[0]) for pool in pools.values())",
     "episodes: a factory's environments of a second class get no tool schemas",
     [EPISODES + "test_a_factory_whose_environments_differ_in_class_renders_each_ones_tools"]),
    # 173-: the agent benchmark's chain task (benchmarks/tool_use.py)
    ("benchmarks/tool_use.py", 'tool_turn("add", a * b, x)', 'tool_turn("add", a, x)',
     "tool_use benchmark: the warm-up's add call on the first factor, not on the product",
     [TOOL_USE + "test_chain_data_answers_and_warmup_conversations_call_multiply_then_add_on_its_result"]),
    ("benchmarks/tool_use.py", "best = args.stage_models[scores.index(max(scores))]",
     "best = args.stage_models[scores.index(min(scores))]",
     "tool_use benchmark: gkd distilled from the worse RL model",
     [TOOL_USE + "test_pick_links_the_rl_model_of_higher_held_out_accuracy_and_the_first_when_tied"]),
    ("benchmarks/tool_use.py", '{"warmup": [], "gkd": [(seed, "pick")]}', '{"warmup": []}',
     "tool_use benchmark: gkd started with the warm-up, before its teacher is picked",
     [TOOL_USE + "test_stage_graph_gkd_learns_from_the_pick_of_the_better_rl_model_after_both_are_evaluated"]),
    ("benchmarks/tool_use.py", "warmup_max_length=512,", "warmup_max_length=384,",
     "tool_use benchmark: the chain task's warm-up conversations cut before their final answer",
     [TOOL_USE + "test_the_evaluation_runs_a_call_and_reads_the_final_reply"]),
    # 177-: the agent benchmark's mixed task
    ("benchmarks/tool_use.py", 'whole = tool_turn("multiply", b, c[0])', 'whole = tool_turn("multiply", a, b)',
     "tool_use benchmark: the plus-first warm-up multiplies the first two numbers",
     [TOOL_USE + "test_mixed_data_half_plus_first_whose_warmup_chains_in_a_few_multiplying_the_last_two"]),
    ("benchmarks/tool_use.py", 'f"What is {a} plus {b} times {c[0]}?", a + b * c[0]',
     'f"What is {a} plus {b} times {c[0]}?", (a + b) * c[0]',
     "tool_use benchmark: plus-first questions answered left to right, plus before times",
     [TOOL_USE + "test_mixed_data_half_plus_first_whose_warmup_chains_in_a_few_multiplying_the_last_two"]),
    ("benchmarks/tool_use.py", 'draw < TASKS[args.task]["plus_first_share"]', "draw < args.tool_share",
     "tool_use benchmark: the plus-first warm-up chains as often as the other form",
     [TOOL_USE + "test_mixed_data_half_plus_first_whose_warmup_chains_in_a_few_multiplying_the_last_two"]),
    ("benchmarks/tool_use.py", "if f == flag) / max(", "if f != flag) / max(",
     "tool_use benchmark: each form's accuracy counted on the other form's questions",
     [TOOL_USE + "test_by_form_pools_the_seeds_on_each_form"]),
    ("benchmarks/tool_use.py", 'tool_turn("add", b * c[0], a)', 'tool_turn("add", b * c[0], c[0])',
     "tool_use benchmark: the plus-first warm-up adds the last number, not the first",
     [TOOL_USE + "test_mixed_data_half_plus_first_whose_warmup_chains_in_a_few_multiplying_the_last_two"]),
    ("benchmarks/tool_use.py", 'str(min(task["group"], completions))', "str(min(8, completions))",
     "tool_use benchmark: the mixed task's grpo in groups of 8, not its 4",
     [TOOL_USE + "test_stage_graph_gkd_learns_from_the_pick_of_the_better_rl_model_after_both_are_evaluated"]),
    ("benchmarks/tool_use.py", '"learning_rates", {}) | args.learning_rates', '"learning_rates", {})',
     "tool_use benchmark: --learning_rates ignored where the task sets its own",
     [TOOL_USE + "test_stage_graph_gkd_learns_from_the_pick_of_the_better_rl_model_after_both_are_evaluated"]),
    # 184-: --reward_timeout (a user's scoring function that hangs)
    ("common/rewards.py", "    finally:\n        timer.cancel()\n", "",
     "rewards: the watchdog of a function that returned in time left running (the run ends later)",
     [HANG]),
    ("common/rewards.py", "threading.Timer(timeout or None,", "threading.Timer(timeout,",
     "rewards: --reward_timeout 0 a limit of 0 s, not none",
     [HANG]),
    ("common/rewards.py", "called(n, f, kwargs, timeout)", "called(n, f, kwargs)",
     "rewards: reward functions called with no time limit",
     [TIMEOUT_REACHES + "[grpo]"]),
    ("common/runtime.py", "    with contextlib.suppress(SystemExit), exit_on_user_error():\n",
     "    with exit_on_user_error():\n",
     "runtime: exit_now's SystemExit ends the watchdog's thread, not the process (the run hangs on)",
     [HANG]),
    ("algos/grpo.py", ", timeout=args.reward_timeout)", ")",
     "grpo: --reward_timeout not given to the reward functions",
     [TIMEOUT_REACHES + "[grpo]"]),
    ("algos/rloo.py", ", timeout=args.reward_timeout)", ")",
     "rloo: --reward_timeout not given to the reward functions",
     [TIMEOUT_REACHES + "[rloo]"]),
    ("algos/ppo.py", "                                             timeout=args.reward_timeout,\n", "",
     "ppo: --reward_timeout not given to the reward functions",
     [TIMEOUT_REACHES + "[ppo]"]),
    ("algos/online_dpo.py", "                    timeout=args.reward_timeout,\n", "",
     "online_dpo: --reward_timeout not given to the reward functions",
     [TIMEOUT_REACHES + "[online_dpo]"]),
    ("algos/online_dpo.py", "import_judge(args.judge, args.reward_timeout)", "import_judge(args.judge)",
     "online_dpo: the judge called with no time limit",
     [TIMEOUT_REACHES + "[online_dpo_judge]"]),
    ("common/reward_extras.py", "kwargs | asked, self.timeout)", "kwargs | asked)",
     "reward extras: functions asking for TRL's extras called with no time limit",
     [TIMEOUT_REACHES + "[grpo_extras]"]),
    ("common/reward_extras.py", "awaited, {}, self.timeout,", "awaited, {}, 0,",
     "reward extras: async functions awaited with no time limit",
     [TIMEOUT_REACHES + "[grpo_extras]"]),
    # 195-: an environment's reset (user code) under --tool_timeout; a negative --reward_timeout refused
    ("common/episodes.py", "env.reset, row, tools.timeout or 0,", "env.reset, row, 0,",
     "episodes: an environment's reset called with no time limit (one that hangs hangs the run)",
     [RESET]),
    ("common/episodes.py", 'what="environment",\n                           flag="--tool_timeout")',
     'what="environment")',
     "episodes: a reset that hangs named as past --reward_timeout, not the --tool_timeout it ran past",
     [RESET]),
    ("common/episodes.py", "if extra := called(env.reset.__qualname__, env.reset, row, tools.timeout or 0, "
     'what="environment",\n                           flag="--tool_timeout"):',
     "if extra := env.reset(**row):",
     "episodes: reset called bare (what it raises a traceback, no limit)",
     [RESET]),
    ("common/rewards.py", "ran past {flag} (", "ran past --reward_timeout (",
     "rewards: the watchdog's line names --reward_timeout whatever set the limit",
     [RESET]),
    ("common/runtime.py", '(*POSITIVE, "reward_timeout", "tool_timeout")', '(*POSITIVE, "tool_timeout")',
     "runtime: a negative --reward_timeout not refused (it fires at once)",
     [TIMEOUT_FLAGS + "[rloo]"]),
    ("common/runtime.py", '(*POSITIVE, "reward_timeout", "tool_timeout")', '(*POSITIVE, "reward_timeout")',
     "runtime: a negative --tool_timeout not refused (every tool call times out at once)",
     [TIMEOUT_FLAGS + "[gkd]"]),
    ("common/runtime.py", "(value < 0 or value == 0 and name in POSITIVE)", "value <= 0",
     "runtime: --reward_timeout 0 (no limit) refused",
     [TIMEOUT_FLAGS + "[ppo]"]),
    ("common/runtime.py", "{'>' if name in POSITIVE else '>='} 0", "{'>=' if name in POSITIVE else '>'} 0",
     "runtime: the bound in the refusal's line swapped (>= 0 for the positive flags)",
     [TIMEOUT_FLAGS + "[grpo]"]),
    # 203-: async tools, environment methods and get_reward awaited on the run's one event loop (TRL's contract)
    ("common/episodes.py", 'answer["result"] = resolved(fn(**arguments))', 'answer["result"] = fn(**arguments)',
     "episodes: an async tool's coroutine answered as its str, never awaited",
     [ASYNC_TOOLS]),
    ("common/episodes.py", "[resolved(e.get_reward()) if type(e) is _cls", "[e.get_reward() if type(e) is _cls",
     "episodes: an environment's async get_reward not awaited (its coroutine as the reward)",
     [ASYNC_TOOLS]),
    ("common/event_loop.py", "        if _loop is None:\n", "        if True:\n",
     "event loop: a new loop for every await (a client kept between calls is on another loop)",
     [ASYNC_TOOLS]),
    ("common/event_loop.py", "if inspect.iscoroutine(value)", "if inspect.iscoroutinefunction(value)",
     "event loop: coroutines returned as they are, never awaited",
     [ASYNC_TOOLS]),
    # 207-: an environment's factory under --tool_timeout; calls that did not parse or name no tool
    ("common/episodes.py", "pool.append(made(self.factories[name], self.timeout))",
     "pool.append(self.factories[name]())",
     "episodes: an environment made for a batch by a bare factory call (a traceback, no limit)",
     [RESET]),
    ("common/episodes.py", "[made(factory, timeout) for _ in range", "[factory() for _ in range",
     "episodes: the environments made at start-up by bare factory calls (a traceback, no limit)",
     [RESET]),
    ("common/episodes.py", "return called(getattr(factory, \"__qualname__\", str(factory)), factory, {}, timeout or 0,",
     "return called(getattr(factory, \"__qualname__\", str(factory)), factory, {}, 0,",
     "episodes: environment factories called with no time limit",
     [RESET]),
    ("common/episodes.py", 'raise ValueError(call.get("error") or f"Tool {name} not found.")',
     'raise ValueError(f"Tool {name} not found.")',
     "episodes: a call that did not parse answered as an unknown tool (the parse error lost)",
     [EPISODES + "test_failed_calls_are_answered_and_counted_and_episodes_end_as_they_should"]),
]


def copy_project(dest: str):
    """The working tree without caches, outputs or git data."""
    skip = shutil.ignore_patterns(".git", "__pycache__", "*.pyc", "output", "wandb", ".pytest_cache", "*.egg-info",
                                  ".venv*")  # .ci/vllm may be building its environment meanwhile
    shutil.copytree(ROOT, dest, ignore=skip)


# PYTEST_DISABLE_PLUGIN_AUTOLOAD: the tests use no pytest plugin, and each row's pytest loaded those installed
# beside it (hypothesis', typeguard's, anyio's, pytest-benchmark's here): 2026-12-06, rows 1-10 one at a time took
# 45 s with them, 30 s without
ENV = dict(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled", OMP_NUM_THREADS="1",
           TOKENIZERS_PARALLELISM="false", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
PROJECT = ("algos", "common", "benchmarks", "tests")  # the packages a copy holds: imported afresh in each run


def pytest_in(where: str, tests: list[str], log: str):
    """In a process forked from the server: forget the project's modules, then pytest `tests` inside `where`
    (its modules first on the path, for the tests' own subprocesses too), its output into `log`."""
    for name in [m for m in sys.modules if m.split(".")[0] in PROJECT]:
        del sys.modules[name]
    sys.path[:] = [where] + [p for p in sys.path if os.path.abspath(p or ".") != ROOT]
    os.chdir(where)
    os.environ["PYTHONPATH"] = where
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, 1)
    os.dup2(out, 2)
    import pytest

    # its temporary files inside the copy (removed with it): a forked run leaves by os._exit, without pytest's own
    # clean-up of /tmp/pytest-of-<user>, which kept ~8 MB a row there
    code = pytest.main(["-x", "-q", "-p", "no:cacheprovider", "-m", "", "--basetemp", os.path.join(where, ".tmp"),
                        *tests])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code))


def run_tests(where: str, tests: list[str]) -> tuple[int, str, float]:
    """pytest on `tests` inside `where`, forked from the server; (exit code, output, seconds)."""
    start, log = time.time(), os.path.join(where, "pytest.log")
    proc = multiprocessing.get_context("forkserver").Process(target=pytest_in, args=(where, tests, log))
    proc.start()
    proc.join(1800)
    if proc.exitcode is None:  # hung: killed, and counted as a failure (exit code -9)
        proc.kill()
        proc.join()
    output = open(log).read() if os.path.exists(log) else "(the forked run ended before pytest started)"
    return proc.exitcode, output, time.time() - start


def failing_test(output: str) -> str:
    found = re.search(r"^FAILED (\S+)", output, re.M)
    return found.group(1) if found else "(exit code only)"


def check(only: list[int] | None = None, jobs: int = 2) -> list[dict]:
    chosen = [(i, m) for i, m in enumerate(MUTATIONS, 1) if not only or i in only]
    jobs = max(1, min(jobs, len(chosen)))
    # the server starts with this environment (one OpenMP thread is read when torch loads) and imports the
    # chosen rows' test modules, with them torch, transformers and the rest, from this project
    os.environ.update(ENV)
    files = sorted({t.split("::")[0] for _, m in chosen for t in m[4]})
    multiprocessing.set_forkserver_preload([f.removesuffix(".py").replace("/", ".") for f in files])
    results = []
    with tempfile.TemporaryDirectory(prefix="mutation-") as tmp, ThreadPoolExecutor(jobs) as pool:
        copies = queue.Queue()  # one project copy per job; a mutation borrows one and restores it
        for k in range(jobs):
            copy_project(os.path.join(tmp, f"project{k}"))
            copies.put(os.path.join(tmp, f"project{k}"))
        baseline = sorted({t for _, m in chosen for t in m[4]})
        start = time.time()
        parts = [(os.path.join(tmp, f"project{k}"), baseline[k::jobs]) for k in range(jobs) if baseline[k::jobs]]
        for code, output, _ in pool.map(lambda part: run_tests(*part), parts):
            if code != 0:
                raise SystemExit(f"the tests fail on the unchanged project, so a mutation proves nothing:\n"
                                 f"{output[-3000:]}")
        print(f"unchanged project: {len(baseline)} tests pass ({time.time() - start:.0f} s)", flush=True)

        def attempt(i, path, text, replacement, bug, tests):
            where = copies.get()
            try:
                file = os.path.join(where, path)
                with open(file) as f:
                    source = f.read()
                if source.count(text) != 1:
                    raise SystemExit(f"mutation {i}: {text!r} occurs {source.count(text)} times in {path}, not once")
                with open(file, "w") as f:
                    f.write(source.replace(text, replacement))
                try:
                    code, output, seconds = run_tests(where, tests)
                finally:
                    with open(file, "w") as f:
                        f.write(source)
            finally:
                copies.put(where)
            caught = code != 0
            return {"n": i, "file": path, "bug": bug, "caught": caught, "seconds": seconds,
                    "by": failing_test(output) if caught else "NOT CAUGHT"}

        for done in as_completed([pool.submit(attempt, i, *m) for i, m in chosen]):
            r = done.result()
            results.append(r)
            print(f"{r['n']:2d}. {'caught' if r['caught'] else 'MISSED'} in {r['seconds']:4.0f} s  {r['bug']}  "
                  f"<- {r['by']}", flush=True)
    return sorted(results, key=lambda r: r["n"])


def table(results: list[dict]) -> str:
    lines = ["| # | file | bug | caught by | s |", "|---|---|---|---|---|"]
    lines += [f"| {r['n']} | {r['file']} | {r['bug']} | `{r['by']}` | {r['seconds']:.0f} |" for r in results]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)  # run as a script: the forked runs find this module as tests.mutation_check
    from tests.mutation_check import check, table  # noqa: F811  (pickled by that name for the server)

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", type=int, nargs="*", help="mutation numbers to run (default: all)")
    parser.add_argument("--jobs", type=int, default=2, help="mutations run at a time, each in its own copy")
    options = parser.parse_args()
    results = check(options.only, options.jobs)
    print(table(results))
    missed = [r for r in results if not r["caught"]]
    print(f"{len(results) - len(missed)} of {len(results)} caught")
    sys.exit(1 if missed else 0)

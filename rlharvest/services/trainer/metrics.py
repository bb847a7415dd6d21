"""Prometheus metrics of a trainer (one trainer per process, so the default registry)."""

from prometheus_client import Counter, Gauge, Histogram

STEPS = Counter("rlh_trainer_steps_total", "RL steps", ["outcome"])  # applied | retried | failed
STEP = Gauge("rlh_trainer_step", "RL steps applied so far")
WEIGHT_VERSION = Gauge("rlh_trainer_weight_version", "Version the trainer's weights carry")
REWARD = Gauge("rlh_trainer_mean_reward", "Mean reward of the last step")
LOSS = Gauge("rlh_trainer_loss", "Loss of the last step")
GRAD_NORM = Gauge("rlh_trainer_grad_norm", "Gradient norm of the last step, before clipping")
STEP_SECONDS = Histogram("rlh_trainer_step_seconds", "Wall time of one RL step",
                         buckets=(0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600))
TOKENS_TRAINED = Counter("rlh_trainer_tokens_trained_total", "Completion tokens trained on")
TOKENS_PER_SECOND = Gauge("rlh_trainer_tokens_trained_per_second",
                          "Tokens trained / step wall time, last step")
MICRO_BATCHES = Counter("rlh_trainer_micro_batches_total", "Micro-batches run")
MICRO_BATCH_WAIT = Histogram("rlh_trainer_micro_batch_wait_seconds",
                             "Trainer idle, waiting for the next rewarded group",
                             buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
ROUNDS = Counter("rlh_trainer_rounds_total", "Tail batching rounds applied", ["kind"])  # short|long
PROMPTS_DEFERRED = Counter("rlh_trainer_prompts_deferred_total",
                           "Prompts a short round deferred to a long round (tail batching)")
TOKENS_DISCARDED = Counter("rlh_trainer_tokens_discarded_total",
                           "Finished completion tokens that did not train (tail batching: beyond "
                           "R0, or of a deferred prompt)")
# Every reward task the trainer started, by how it ended: scored, failed (raised or timed out;
# also in rlh_trainer_reward_failures_total) or cancelled (a deferred group's, or a step's that
# was cancelled itself).
TRAJECTORIES = Counter("rlh_trainer_trajectories_total", "Agentic trajectories (--env) played, "
                       "by outcome: played, or failed by the environment", ["outcome"])
REWARDS = Counter("rlh_trainer_rewards_total", "Reward tasks by outcome", ["outcome"])
REWARD_FAILURES = Counter("rlh_trainer_reward_failures_total", "Rewards that failed or timed out")
MIGRATIONS = Counter("rlh_trainer_request_migrations_total", "Request moves seen in completions")
REPUBLISHED = Counter("rlh_trainer_versions_republished_total", "Versions published again "
                      "because no agent and no worker held them (their agent died first)")
PUBLISH_SECONDS = Histogram("rlh_trainer_publish_seconds", "Publishing one version to the agent",
                            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
PUBLISH_CHANGED = Gauge("rlh_trainer_publish_changed_fraction", "Fraction of the elements of "
                        "the last published version whose bits changed since the one before "
                        "(1 for a first or dense publish): the sparsity delta transfer rides on")
PUBLISH_PAYLOAD = Gauge("rlh_trainer_publish_payload_ratio", "Bytes the last publish sent over "
                        "the bytes of the whole model dense")
CHECKPOINT_SECONDS = Histogram("rlh_trainer_checkpoint_seconds", "Writing one checkpoint",
                               buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
STEP_RESUMES = Counter("rlh_trainer_step_resumes_total",
                       "Steps resumed at a dead manager's successor with their tokens")
THREADS = Gauge("rlh_trainer_threads", "Intra-op threads of the training thread's last call "
                "(--borrow-lent-threads: more while rollout workers are lent to training)")
LENT_THREAD_CALLS = Counter("rlh_trainer_lent_thread_calls_total",
                            "Training-thread calls that ran on lent rollout workers' threads")
RANKS = Gauge("rlh_trainer_ranks", "Ranks training this job (1: a one-process trainer)")
RANK_COMMAND_SECONDS = Histogram(
    "rlh_trainer_rank_command_seconds",
    "One command carried out by every rank: rank 0's broadcast to the last rank's reply",
    ["command"], buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
RANK_FAILURES = Counter("rlh_trainer_rank_failures_total",
                        "Commands that failed on a rank or whose collective broke (a rank died)")
PERMIT_WAIT_SECONDS = Histogram("rlh_trainer_permit_wait_seconds", "Waiting for the placement "
                                "scheduler's permit for a phase (--placement-scheduler)",
                                ["phase"], buckets=(0.01, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300))
PERMIT_HELD_SECONDS = Histogram("rlh_trainer_permit_held_seconds", "A phase run under a "
                                "permit, from grant to release (--placement-scheduler)",
                                ["phase"], buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800))

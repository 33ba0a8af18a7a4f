"""The small experiments the planner is checked against a real gloo run on (4 ranks): the embedded
default (tiny Llama, shipped data) with accumulation, with and without activation checkpointing.
The same overrides go to `python -m dtrain.estimate` and to the real run."""

WORLD = 4
_COMMON = [f"estimate.world_size={WORLD}", "estimate.format=json"]
SCENARIOS = {
    "tp2_checkpointed": [
        *_COMMON,
        "parallel.tp=2",
        "parallel.activation_checkpointing=full",
        "train.micro_batch_size=4",
    ],
    "tp4_plain": [*_COMMON, "parallel.tp=4", "train.micro_batch_size=8"],
}

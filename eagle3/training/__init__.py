"""Training the draft: the vocab mapping (d2t/t2d), and speculators' Eagle3DraftModel under its own
Trainer, in this process on CPU or under torchrun on GPUs, with its metrics, timings and curves;
then its export as the checkpoint `vllm serve` loads."""

"""Self-distillation training of the MTP Eagle draft head: dataset building, dense forwards, trainer, eval."""

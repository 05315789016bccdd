"""Pure-torch speculative decoding: lookahead, draft inputs, MTP Eagle head, verification, stats, training."""

"""What heads and probes share to train: seeded generators that leave global RNG state alone, and the
early-stopping loop."""

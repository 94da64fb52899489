"""`mtad-edge bench`: speed, acceptance, perplexity and energy of every method, side by side."""

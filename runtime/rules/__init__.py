"""The rules: pure numpy sampling, verification and tree acceptance, in the papers' notation (p = target, q = draft)."""

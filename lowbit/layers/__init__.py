"""Building blocks the model families are made of."""

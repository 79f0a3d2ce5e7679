"""An example pd-gateway policy plugin (see policy.py)."""

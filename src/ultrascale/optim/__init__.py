"""Optimizers beyond PyTorch's own: Muon (muon.py) for the hidden matrices, AdamW for the rest."""

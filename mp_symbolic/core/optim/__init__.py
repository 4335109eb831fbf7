"""Parameters and optimizer state: initial values, the updates, ZeRO-1, the
Trainer, state by name.
"""

"""The tensor-parallel layers and their automatic placement in a network."""

"""Where tensors leave a stage or a shard: the declared Transport and control
plane, the node processes."""

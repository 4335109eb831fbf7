"""The graph placed on devices: which stage and shard each node is, blocks per
stage, devices per stage."""

"""A shard: which prompts it holds and its names (`layout`), its file, filled as the engine
hands over values and hashed as it is written (`file`), the record kept beside it (`record`),
and its writing, from forward passes to a published file and its record (`writing`). The
flow's tasks (`tasks.shards`) are thin Prefect wrappers over `writing`."""

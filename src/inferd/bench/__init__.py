"""The benchmark: in-process ceiling, naive baseline, inferd closed and open loop (`inferd bench`)."""

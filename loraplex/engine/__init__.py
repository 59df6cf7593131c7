"""Engine: requests, sampling, scheduler, KV cache, runner, step loop."""

"""Engine: requests, scheduler, KV block manager, model runner, sampler, detokenizer."""

"""The running side: a task run, its context and calls, workers, resume, the replayer."""

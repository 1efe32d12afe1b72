"""Batch jobs from files (OpenAI's Files and Batches API): lines, the store, the files on disk, the runner."""

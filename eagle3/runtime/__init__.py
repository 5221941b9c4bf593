"""What every GPU step stands on: devices and their claims, one child process per attempt with an
out-of-memory back-off, file locks, timing, and the test hooks that make failures happen on purpose.
Imports nothing else of the pipeline."""

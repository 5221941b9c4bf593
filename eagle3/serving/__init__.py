"""What a vLLM server reads and serves: the exported checkpoint, and the client every step that
talks to a server uses."""

"""The client every step that talks to an OpenAI-compatible server (`vllm serve`) uses: requests
with retries and errors that name the server, and records spread over several replicas."""

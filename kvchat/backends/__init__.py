"""What runs the model, behind one interface (protocol.py): the local engine (local.py) and,
as a second implementation, a vLLM server. The app, the CLI and the bench type against
`Backend` and `Chat` and read nothing else."""

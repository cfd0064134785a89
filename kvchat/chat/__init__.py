"""The chat screen and what acts on it: the conversation's view, the open conversations, the job queue and the
turn relay, the keys and slash commands, editing, sampling, the draft counter, copying, the chat browser."""

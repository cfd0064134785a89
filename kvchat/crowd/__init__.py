"""The crowd (issue 23): simulated users chatting in the same pool as the user's own
conversation, through the Backend protocol, so one long chat is seen slowing the others."""

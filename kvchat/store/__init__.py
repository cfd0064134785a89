"""What kvchat keeps on disk: conversation logs and their turn records, the saved-conversation catalog, the
settings file, and bounded reads of the files a user names."""

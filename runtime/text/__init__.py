"""Text: chat templates, special tokens, vocabularies and how two of them meet."""

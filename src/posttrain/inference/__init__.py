"""After training: load an export, chat with it or generate from it, merge an adapter into its base."""

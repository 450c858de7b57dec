"""The SMS Spam Collection: fetch, balance and split as the reference, tokenise, and the loaders."""

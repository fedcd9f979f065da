"""Task families: tools, prompt, verifier, and state restore at any prefix."""

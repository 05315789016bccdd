"""Ray actors and the model side: Llama-family target, paged attention, loaders, runners."""

"""Code that runs only inside the spawned checkpoint worker process."""

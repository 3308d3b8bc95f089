"""Training: run configuration, microbatch schedules, optimizer, checkpointing and data."""

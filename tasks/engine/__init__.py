"""What runs when: the scheduler's choice, the job server and its broker, the Ray cluster, the timeline."""

"""Rewards: the reward-model worker (scoring, Bradley-Terry training) and rule-based rewards (``rules``)."""

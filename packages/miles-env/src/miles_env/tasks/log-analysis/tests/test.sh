#!/bin/bash
# Verifier of log-analysis: reward 1 when /tests/check.py passes, else 0.
mkdir -p /logs/verifier
if python3 /tests/check.py; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi

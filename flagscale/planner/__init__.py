"""The SLO planner (docs/autoscaling.md): how many replicas a pool needs to keep its latency objective, as pure
logic that the real deployment (Serve's custom autoscaling policy, flagscale/replica/slo_policy.py) and the
simulator (simulate.py, benchmarks/slo_planner.py) drive alike.

types.py: the SLO, the planner's settings, one tick's observation of a pool and the decision it gets;
histogram.py: a percentile from the engines' latency histograms (bucket counts between two scrapes);
forecast.py: the load predictor (a level and a trend, smoothed over minutes); capacity.py: what one replica
sustains within the SLO, fitted online from the latency it shows at the load it carries; planner.py: the
decision (size for the forecast, hysteresis, upscale/downscale delays, min/max) and its reason;
simulate.py: a simulated cluster (replicas with a capacity curve, start and drain times) replaying a trace;
trace.py: the seeded bursty trace; seeds.py: the planner's starting figures from auto_tune's history.csv.

Nothing here imports the rest of the project: it sits with the engines on the floor above the basics.
"""

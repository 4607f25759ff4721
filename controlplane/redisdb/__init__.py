"""redisdb"""

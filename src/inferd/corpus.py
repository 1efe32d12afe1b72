"""The benchmark corpus: distinct English, Chinese and mixed texts, made from a seed (no downloads).

Lengths follow a log-normal distribution of *tokens* (median 40, sigma 0.85, clipped to 5..250, counting
[CLS] and [SEP]), which is what an embedding service sees: many short queries, a long tail of passages.
With a BERT WordPiece tokenizer (the default MiniLM's) the target is met exactly: every English word below
is one token of its vocabulary, every CJK character is one token (its own piece or [UNK]), and every
punctuation mark is one token. ``estimate_tokens`` counts the same way, so tests can check it.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

MIN_TOKENS = 5
MAX_TOKENS = 250
MEDIAN_TOKENS = 40
SIGMA = 0.85
DEFAULT_COUNT = 2500
DEFAULT_SEED = 20240601
# Share of each language among the texts (the rest: Chinese with English terms mixed in).
SHARE_EN = 0.5
SHARE_ZH = 0.35

# Common English words, each a single token of bert-base-uncased's vocabulary (checked against it).
_EN_TEXT = """
time year people way day man thing woman life child world school state family student group country problem hand
part place case week company system program question work government number night point home water room mother
area money story fact month lot right study book eye job word business issue side kind head house service friend
father power hour game line end member law car city community name president team minute idea kid body
information back parent face others level office door health person art war history party result change morning
reason research girl guy moment air teacher force education foot boy age policy process music market sense
nation plan college interest death experience effect use class control care field development role effort rate
heart drug show leader light voice wife police mind price report decision son view relationship town road arm
difference value building action model season society tax director position player record paper space ground
form event official matter center couple project activity star table need court oil situation cost industry
figure street image phone data picture practice piece land product doctor wall patient worker news test movie
north love support technology step baby computer type attention film tree source organization hair window
evidence population network memory server client request response queue batch token vector speed error message
signal answer search language text sentence machine learning training cloud storage file list order shop travel
train station river mountain weather rain summer winter coffee food dinner lunch kitchen garden animal dog cat
bird fish flower ocean island bridge good new first last long great little own other old big high different
small large next early young important few public bad same able free sure clear full special easy strong
certain major better whole simple fast slow short hot cold open close quick late recent main local human happy
real best true hard make take see come know get give find think tell become leave feel bring begin keep hold
write stand hear let mean set meet run pay sit speak lie lead read grow lose fall send build stay play move live
believe happen include continue watch follow stop create learn understand carry talk offer remember consider
appear buy wait serve die expect start walk win return help explain develop reach the a an is are was were be
been to of and in on for with that this it as at by from or not but all any can will would should could may
might must very also just only still even more most much many some such
"""
EN_WORDS = tuple(_EN_TEXT.split())

# Common Chinese words (one token per character for BERT-style tokenizers).
_ZH_TEXT = """
我们 你们 他们 今天 明天 昨天 时间 问题 服务 模型 推理 请求 响应 队列 批处理 数据 系统 用户 网络 内存 显存
延迟 吞吐 性能 测试 部署 配置 日志 监控 指标 错误 文本 句子 向量 语言 机器 学习 训练 城市 天气 下雨 夏天 冬天
咖啡 早饭 晚饭 朋友 家人 学校 老师 学生 公司 工作 会议 报告 项目 计划 市场 价格 经济 发展 技术 研究 历史 文化
音乐 电影 图书 新闻 健康 医生 医院 运动 旅行 火车 飞机 河流 山脉 花园 动物 小狗 小猫 鸟儿 大海 岛屿 桥梁 道路
重要 简单 快速 缓慢 清楚 容易 困难 美丽 安静 热闹 需要 可以 应该 已经 正在 开始 结束 继续 发现 知道 认为 希望
觉得 喜欢 使用 处理 提高 降低 增加 减少 分析 解决 支持 提供 完成 建立 参加 讨论 准备 检查 记录 发送 接收
的 了 在 是 有 和 也 都 就 很 还 又 把 被 让 给 从 对 向 到 说 看 想 做 去 来 要 会 能
"""
ZH_WORDS = tuple(_ZH_TEXT.split())
ZH_PUNCT = ("，", "，", "，", "。", "。", "？", "！", "；")
EN_PUNCT_END = (".", ".", ".", ".", "?", "!")

_CJK = re.compile(r"[\u3000-\u303f\u4e00-\u9fff\uff00-\uffef]")
_WORD = re.compile(r"[A-Za-z]+|[0-9]+|[^\sA-Za-z0-9\u3000-\u303f\u4e00-\u9fff\uff00-\uffef]")


@dataclass(frozen=True)
class CorpusText:
    text: str
    lang: str  # "en", "zh" or "mixed"
    target_tokens: int  # with [CLS] and [SEP]


def estimate_tokens(text: str) -> int:
    """Tokens a BERT WordPiece tokenizer gives this corpus's texts, [CLS] and [SEP] included."""
    return 2 + len(_CJK.findall(text)) + len(_WORD.findall(text))


def _target_length(rng: random.Random) -> int:
    n = round(rng.lognormvariate(0.0, SIGMA) * MEDIAN_TOKENS)
    return min(MAX_TOKENS, max(MIN_TOKENS, n))


def _english(rng: random.Random, budget: int) -> str:
    """Sentences of exactly ``budget`` tokens: words, an occasional comma, and sentence ends."""
    out: list[str] = []
    while budget > 0:
        if budget == 1:
            out.append(rng.choice(("Right", "Sure", "True")))  # a one-word reply fills the last token
            break
        n = min(rng.randint(3, 18), budget - 1)  # words; one token is kept for the sentence end
        words = [rng.choice(EN_WORDS) for _ in range(n)]
        words[0] = words[0].capitalize()
        budget -= n + 1
        if n >= 8 and budget >= 2 and rng.random() < 0.4:
            cut = rng.randint(2, n - 2)
            words[cut] = words[cut] + ","
            budget -= 1
        out.append(" ".join(words) + rng.choice(EN_PUNCT_END))
    return " ".join(out)


def _chinese_run(rng: random.Random, budget: int) -> list[str]:
    """Characters and punctuation, exactly ``budget`` tokens, as a list of pieces to join."""
    out: list[str] = []
    clause = 0
    while budget > 0:
        if clause >= rng.randint(6, 16) and budget >= 2:
            out.append(rng.choice(ZH_PUNCT))
            budget -= 1
            clause = 0
            continue
        w = rng.choice(ZH_WORDS)
        if len(w) > budget:
            w = rng.choice([x for x in ZH_WORDS if len(x) == 1])
        out.append(w)
        budget -= len(w)
        clause += len(w)
    return out


def _chinese(rng: random.Random, budget: int) -> str:
    if budget >= 2:
        return "".join(_chinese_run(rng, budget - 1)) + "。"
    return "".join(_chinese_run(rng, budget))


def _mixed(rng: random.Random, budget: int) -> str:
    """Chinese with English terms inside it, as people write about software; always holds both."""
    parts: list[str] = []
    english = rng.random() < 0.5  # which language opens the text
    first = True
    while budget > 0:
        if english:
            n = min(rng.randint(1, 3), budget - (1 if first else 0))
            parts.append(" " + " ".join(rng.choice(EN_WORDS) for _ in range(n)) + " ")
        else:
            n = min(rng.randint(2, 10), budget - (1 if first else 0))
            parts.append("".join(_chinese_run(rng, n)))
        budget -= n
        # The second part is the other language (so both appear); after that, mostly Chinese.
        english = (not english) if first else rng.random() < 0.3
        first = False
    return "".join(parts).strip()


_MAKERS = {"en": _english, "zh": _chinese, "mixed": _mixed}


def generate(count: int = DEFAULT_COUNT, seed: int = DEFAULT_SEED) -> list[CorpusText]:
    """``count`` distinct texts, the same for the same seed."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[CorpusText] = []
    while len(out) < count:
        r = rng.random()
        lang = "en" if r < SHARE_EN else "zh" if r < SHARE_EN + SHARE_ZH else "mixed"
        target = _target_length(rng)
        text = _MAKERS[lang](rng, target - 2)
        if text in seen or estimate_tokens(text) != target:
            continue  # a short text drawn twice; draw again (the check on length is a safety net)
        seen.add(text)
        out.append(CorpusText(text, lang, target))
    return out


def texts(count: int = DEFAULT_COUNT, seed: int = DEFAULT_SEED) -> list[str]:
    return [t.text for t in generate(count, seed)]

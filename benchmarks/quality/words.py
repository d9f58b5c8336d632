"""Word pools the quality tasks draw from: filler sentences, needle keys, the common-words
list and the synthetic biographies' names, cities, jobs and hobbies."""

SUBJECTS = (
    "The farmer", "A young engineer", "The old captain", "My neighbour", "The librarian",
    "A tired student", "The baker", "The pilot", "Our teacher", "The gardener", "A quiet painter",
    "The doctor", "The shopkeeper", "A travelling musician", "The mayor", "The fisherman",
)
VERBS = (
    "repaired", "painted", "sold", "borrowed", "described", "carried", "cleaned", "found",
    "photographed", "measured", "moved", "admired", "ignored", "wrapped", "checked", "lost",
)
OBJECTS = (
    "the wooden fence", "a blue bicycle", "the kitchen table", "an old map", "the garden gate",
    "a heavy box", "the red boat", "a small lamp", "the stone bridge", "a broken clock",
    "the village bell", "a basket of apples", "the green door", "a pair of boots",
    "the long ladder", "a bundle of letters",
)
TAILS = (
    "before lunch.", "in the rain.", "on Tuesday.", "near the river.", "after the storm.",
    "with great care.", "for the third time.", "without a word.", "at dawn.",
    "during the festival.", "while humming a song.", "for a neighbour.", "in the old barn.",
    "next to the market.", "late in the evening.", "as the bells rang.",
)
KEY_ADJECTIVES = (
    "amber", "silent", "crimson", "frozen", "golden", "hollow", "ivory", "jagged", "lunar",
    "misty", "noble", "olive", "rapid", "scarlet", "tidal", "velvet", "wild", "young", "azure",
    "bitter",
)
KEY_NOUNS = (
    "falcon", "river", "lantern", "meadow", "harbor", "canyon", "orchard", "glacier", "compass",
    "willow", "thunder", "pebble", "cactus", "anchor", "beacon", "dragon", "violin", "marble",
    "tulip", "comet",
)
COMMON_WORD_POOL = (
    "apple", "bread", "chair", "dance", "eagle", "flute", "grape", "house", "island", "jacket",
    "kettle", "lemon", "mirror", "needle", "ocean", "pencil", "quilt", "rabbit", "saddle",
    "tiger", "umbrella", "valley", "wagon", "yellow", "zebra", "anchor", "button", "candle",
    "dragon", "engine", "forest", "garden", "hammer", "insect", "jungle", "kitten", "ladder",
    "market", "napkin", "orange", "parrot", "rocket", "silver", "tunnel", "violet", "window",
    "basket", "cactus", "donkey", "feather", "goblet", "helmet", "iceberg", "jigsaw", "lantern",
    "meadow", "noodle", "oyster", "pillow", "ribbon", "spider", "teapot", "walnut", "blanket",
    "carrot", "desert", "falcon", "guitar", "harbor", "marble", "pepper", "rubber", "shadow",
    "tomato", "velvet", "whistle", "bottle", "castle", "dolphin", "forest", "glove", "honey",
    "kingdom", "lizard", "mountain", "nectar", "pirate", "puzzle", "river", "salmon", "thunder",
)
FIRST_NAMES = (
    "Alice", "Bruno", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hiro", "Ines", "Jonas",
    "Kira", "Lucas", "Mira", "Nadia", "Oscar", "Petra", "Quentin", "Rosa", "Stefan", "Tanya",
    "Umar", "Vera", "Walter", "Yara", "Zoltan", "Amelia", "Boris", "Celine", "Diego", "Esther",
)
LAST_NAMES = (
    "Abbott", "Brennan", "Castillo", "Dalton", "Eriksen", "Fischer", "Garner", "Holloway",
    "Ivanova", "Jensen", "Kowalski", "Lindqvist", "Moreau", "Novak", "Okafor", "Petrov",
    "Quinn", "Romano", "Sato", "Thorne", "Ueda", "Varga", "Whitaker", "Yilmaz", "Zimmer",
)
CITIES = (
    "Lisbon", "Oslo", "Nairobi", "Toronto", "Kyoto", "Lima", "Dublin", "Prague", "Cairo",
    "Madrid", "Vienna", "Helsinki", "Seoul", "Havana", "Athens", "Warsaw", "Bogota", "Manila",
    "Zurich", "Denver", "Glasgow", "Osaka", "Quito", "Riga", "Tallinn", "Tunis", "Accra", "Perth",
    "Lyon", "Porto", "Krakow", "Bergen", "Geneva", "Austin", "Boston", "Chicago", "Seattle",
    "Hamburg", "Munich", "Naples", "Venice", "Florence", "Seville", "Valencia", "Marseille",
)
PROFESSIONS = (
    "architect", "baker", "carpenter", "dentist", "electrician", "florist", "geologist",
    "historian", "journalist", "lawyer", "mechanic", "nurse", "pharmacist", "plumber",
    "sculptor", "surgeon", "tailor", "veterinarian", "violinist", "zoologist", "astronomer",
    "chemist", "economist", "firefighter", "locksmith", "photographer", "pilot", "translator",
)
HOBBIES = (
    "chess", "fishing", "gardening", "knitting", "painting", "pottery", "rowing", "sailing",
    "skiing", "surfing", "swimming", "climbing", "archery", "cycling", "dancing", "fencing",
    "juggling", "origami", "photography", "singing", "tennis", "volleyball", "woodworking",
)
